"""What routes depend on: the ingress replica's domain objects, the bearer token (applied per router), and the caller
(the admin, a tenant, or nobody: rollout_farm/services/tenants/registry.py)."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from fastapi import Depends, Request
from ray import serve

from rollout_farm.services.errors import Unauthorized
from rollout_farm.services.tenants.registry import Principal

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


async def caller(request: Request, farm: Ingress = Depends(ingress)) -> Principal:
    """Who sends the request: the admin (FARM_API_TOKEN), a tenant (one of its tokens), or nobody (no token); 401 for
    a token that is neither."""
    sent = request.headers.get("authorization", "")
    if not sent:
        return Principal()
    expected = f"Bearer {farm.settings.api_token.get_secret_value()}"
    if hmac.compare_digest(sent.encode(), expected.encode()):
        return Principal(admin=True)
    tenant = await farm.tenants.of_token(sent.removeprefix("Bearer ")) if sent.startswith("Bearer ") else None
    if tenant is None:
        raise Unauthorized("unknown bearer token: send 'Authorization: Bearer <FARM_API_TOKEN or a tenant token>'")
    return Principal(tenant=tenant)


async def require_caller(who: Principal = Depends(caller)) -> Principal:
    """caller, and 401 unless it is the admin or a tenant."""
    if not (who.admin or who.tenant):
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <FARM_API_TOKEN or a tenant token>'")
    return who


async def require_token_for_generation(request: Request, farm: Ingress = Depends(ingress)) -> None:
    """On the routes that generate, where FARM_REQUIRE_TOKEN_FOR_GENERATION is on (a shared cluster): the admin's or a
    tenant's token; off, as for local use, they are open."""
    if farm.settings.require_token_for_generation:
        await require_caller(await caller(request, farm))
