"""What routes depend on: the ingress replica's domain objects, and the bearer token (applied per router)."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from fastapi import Depends, Request
from ray import serve

from rollout_farm.services.errors import Unauthorized

if TYPE_CHECKING:
    from rollout_farm.services.ingress import Ingress


async def ingress() -> Ingress:
    """The Ingress instance of this replica (the object Serve built from rollout_farm/services/ingress.py)."""
    return serve.get_replica_context().servable_object


async def require_token(request: Request, farm: Ingress = Depends(ingress)) -> None:
    """401 unless the request carries `Authorization: Bearer $FARM_API_TOKEN` (compared in constant time)."""
    expected = f"Bearer {farm.settings.api_token.get_secret_value()}"
    if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected.encode()):
        raise Unauthorized("missing or wrong bearer token: send 'Authorization: Bearer $FARM_API_TOKEN'")


async def require_token_for_generation(request: Request, farm: Ingress = Depends(ingress)) -> None:
    """require_token on the routes that generate, where FARM_REQUIRE_TOKEN_FOR_GENERATION is on (a shared cluster);
    off, as for local use, they are open."""
    if farm.settings.require_token_for_generation:
        await require_token(request, farm)
