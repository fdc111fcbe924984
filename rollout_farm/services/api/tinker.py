"""Tinker's sampling API under /api/v1, for the unmodified `tinker` SDK (0.38.0): TINKER_BASE_URL is the farm,
TINKER_API_KEY a tenant token (or the admin token); docs/tenants.md, "Tinker". The work is in
rollout_farm/services/compat/tinker.py. Every other /api/v1 call (training, weights, checkpoints) is a 404 saying so.

Not in /openapi.json: the SDK is the client, and a sample's answer is protobuf, not JSON.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import Response

from rollout_farm.services.api.deps import ingress
from rollout_farm.services.compat.tinker import not_served
from rollout_farm.services.errors import Unauthorized
from rollout_farm.services.protocol import tinker as T
from rollout_farm.services.tenants.registry import Principal

KEY_FIX = "set TINKER_API_KEY to a farm tenant token (tml-farm-...) or the admin token (tml-$FARM_API_TOKEN)"


async def key_holder(request: Request, farm=Depends(ingress)) -> Principal:
    """The caller by Tinker's X-API-Key: the admin (FARM_API_TOKEN, as it is or after 'tml-', the prefix the SDK
    demands) or a tenant (one of its tokens); 401 for anything else."""
    key = request.headers.get("x-api-key", "")
    if not key:
        raise Unauthorized(f"missing X-API-Key: {KEY_FIX}")
    admin = farm.settings.api_token.get_secret_value()
    if any(hmac.compare_digest(key.encode(), k.encode()) for k in (admin, f"tml-{admin}")):
        return Principal(admin=True)
    tenant = await farm.tenants.of_token(key)
    if tenant is None:
        raise Unauthorized(f"unknown X-API-Key: {KEY_FIX}")
    return Principal(tenant=tenant)


router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False, dependencies=[Depends(key_holder)])
BODY = Body(...)


@router.post("/client/config", response_model=T.ClientConfig)
async def client_config():
    return T.ClientConfig()


@router.post("/client/dynamic_config")
async def dynamic_config():
    return {}


@router.post("/create_session", response_model=T.CreateSessionResponse)
async def create_session(who: Principal = Depends(key_holder), farm=Depends(ingress)):
    return await farm.tinker.create_session(who)


@router.post("/session_heartbeat")
async def session_heartbeat(body: dict = BODY, who: Principal = Depends(key_holder), farm=Depends(ingress)):
    return await farm.tinker.heartbeat(body, who)


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, who: Principal = Depends(key_holder), farm=Depends(ingress)):
    return await farm.tinker.finish(session_id, who)


@router.post("/create_sampling_session", response_model=T.CreateSamplingSessionResponse)
async def create_sampling_session(body: dict = BODY, who: Principal = Depends(key_holder), farm=Depends(ingress)):
    """The policy: 'tinker://<name>@v<N>', 'tinker://<name>' (its newest resident version, kept), or base_model."""
    return await farm.tinker.create_sampling_session(body, who)


@router.get("/samplers/{sampler_id}", response_model=T.Sampler)
async def sampler(sampler_id: str, who: Principal = Depends(key_holder), farm=Depends(ingress)):
    return await farm.tinker.sampler(sampler_id, who)


@router.post("/asample", response_model=T.FutureHandle)
async def asample(body: dict = BODY, who: Principal = Depends(key_holder), farm=Depends(ingress)):
    """Start a sample; the caller's tenant is admitted against its quota now (a 429 naming it), its samples counted
    in flight until the sample ends and its tokens charged then."""
    return await farm.tinker.asample(body, who, lambda samples: farm.tenants.admitted(who, samples))


@router.post("/retrieve_future")
async def retrieve_future(body: dict = BODY, who: Principal = Depends(key_holder), farm=Depends(ingress)):
    """The sample's protobuf SampleResponse, `try_again` while it runs (after holding the request ~25 s), its
    error, or 410 when it must be submitted again."""
    out = await farm.tinker.retrieve(body, who)
    return Response(out, media_type="application/x-protobuf") if isinstance(out, bytes) else out


@router.post("/cancel_future")
async def cancel_future():
    """Nothing to do: a sample runs to its end, and its result expires unread."""
    return {}


@router.get("/get_server_capabilities", response_model=T.Capabilities)
async def capabilities(farm=Depends(ingress)):
    return await farm.tinker.capabilities()


@router.post("/telemetry", response_model=T.Accepted)
async def telemetry():
    """The SDK's telemetry, dropped."""
    return T.Accepted()


@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def not_a_sampling_call(path: str):
    """Training, weights, checkpoints and every other Tinker call: a 404 naming what is served."""
    raise not_served(path)
