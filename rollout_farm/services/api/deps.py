"""What routes depend on: the ingress replica's domain objects, the bearer token (applied per router), and the caller
(the admin, a tenant, or nobody: rollout_farm/services/tenants/registry.py)."""

from __future__ import annotations

import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import Depends, Request
from ray import serve

from rollout_farm.services.errors import Unauthorized
from rollout_farm.services.tenants.registry import Principal

if TYPE_CHECKING:
    from rollout_farm.services.api.ingress import Ingress


async def ingress() -> Ingress:
    """The Ingress instance of this replica: the object Serve built from rollout_farm/services/api/ingress.py, or, when
    FARM_FRONT=fused, the one an engine replica holds as its `front` (rollout_farm/services/serving/fused_front.py)."""
    served = serve.get_replica_context().servable_object
    return getattr(served, "front", served)


async def require_token(request: Request, farm: Ingress = Depends(ingress)) -> None:
    """401 unless the request carries `Authorization: Bearer $FARM_API_TOKEN` (compared in constant time)."""
    expected = f"Bearer {farm.settings.api_token.get_secret_value()}"
    if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected.encode()):
        raise Unauthorized("missing or wrong bearer token: send 'Authorization: Bearer $FARM_API_TOKEN'")


async def caller(request: Request, farm: Ingress = Depends(ingress)) -> Principal:
    """Who sends the request: the admin (FARM_API_TOKEN), a tenant (one of its tokens), or nobody: no token, or one
    that is neither (an OpenAI client's placeholder key on an open route: the route decides whether that is enough,
    as before tenants). Anthropic's SDKs and Claude Code send their key as `x-api-key`: without an Authorization
    header, that key is the bearer token."""
    sent = request.headers.get("authorization", "")
    if not sent and (key := request.headers.get("x-api-key")):
        sent = f"Bearer {key}"
    if not sent:
        return Principal()
    expected = f"Bearer {farm.settings.api_token.get_secret_value()}"
    if hmac.compare_digest(sent.encode(), expected.encode()):
        return Principal(admin=True)
    tenant = await farm.tenants.of_token(sent.removeprefix("Bearer ")) if sent.startswith("Bearer ") else None
    return Principal(tenant=tenant) if tenant is not None else Principal()


async def require_caller(request: Request, who: Principal = Depends(caller)) -> Principal:
    """caller, and 401 unless it is the admin or a tenant."""
    if not (who.admin or who.tenant):
        given = "unknown" if request.headers.get("authorization") else "missing"
        raise Unauthorized(f"{given} bearer token: send 'Authorization: Bearer <FARM_API_TOKEN or a tenant token>'")
    return who


async def admitted_stream(
    farm: Ingress,
    who: Principal,
    samples: int,
    start: Callable[[], Awaitable[AsyncIterator[str]]],
    tokens: Callable[[str], int] = lambda line: 0,
):
    """A streamed answer's lines: the caller's tenant admitted before the work starts (a refusal is a plain 429 and
    nothing runs), counted in flight until the last line; `start()` starts the work and gives its lines. Each line's
    generated tokens (`tokens(line)`) are charged against the tenant's tokens_per_s as it goes out, and taken from
    its bucket when the stream ends (also one its caller left)."""
    stack = contextlib.AsyncExitStack()
    took = await stack.enter_async_context(farm.tenants.admitted(who, samples))
    try:
        lines = await start()
    except BaseException:
        await stack.aclose()
        raise

    async def streamed():
        sent = 0
        async with stack:
            try:
                async for line in lines:
                    sent += tokens(line)
                    yield line
            finally:
                took(sent)

    return streamed()


def generated_tokens(groups) -> int:
    return sum(len(s.token_ids) for g in groups for s in g.samples)


def group_line_tokens(line: str) -> int:
    """The tokens a rollout stream's line carries: a GroupEvent's samples' (a StreamEnd: none)."""
    group = json.loads(line).get("group") or {}
    return sum(len(s["token_ids"]) for s in group.get("samples", []))


def episode_line_tokens(line: str) -> int:
    """The tokens an episode stream's line carries: its EpisodeGroup's sampled tokens, those with a weight version
    (an EpisodeStreamEnd: none)."""
    episodes = json.loads(line).get("episodes") or []
    return sum(v >= 0 for e in episodes for seg in e["segments"] for v in seg["token_versions"])


async def require_token_for_generation(request: Request, farm: Ingress = Depends(ingress)) -> None:
    """On the routes that generate, where FARM_REQUIRE_TOKEN_FOR_GENERATION is on (a shared cluster): the admin's or a
    tenant's token; off, as for local use, they are open."""
    if farm.settings.require_token_for_generation:
        await require_caller(request, await caller(request, farm))
