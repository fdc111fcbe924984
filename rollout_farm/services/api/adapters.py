"""LoRA adapters as policies: push a version (upload or path), list, read, retire (docs/tenants.md)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query, Request

from rollout_farm.services import protocol as P
from rollout_farm.services.adapters.registry import not_found
from rollout_farm.services.api.deps import caller, ingress, require_caller
from rollout_farm.services.api.weights import SAFETENSORS_BODY
from rollout_farm.services.errors import Forbidden
from rollout_farm.services.tenants.registry import Principal

ERRORS = {code: {"model": P.ErrorResponse} for code in (401, 403, 404, 409, 413, 422, 503)}
NAME = Path(..., pattern=P.adapters.ADAPTER_NAME, description="The adapter's name.")
router = APIRouter(tags=["adapters"])


async def _own(farm, name: str, who: Principal, change: bool) -> P.AdapterInfo | None:
    """The adapter's record when `who` may see it (change: push to it or retire it); another tenant's adapter is a
    404 to read (nothing about it is told) and a 403 to push to."""
    info = await farm.adapters.info(name)
    if info is None:
        return None
    if await farm.adapters.visible(name, who) is None:
        raise not_found(name)
    if change and not who.may_change(info.owner):
        raise Forbidden(f"adapter {name!r} belongs to the admin: push under another name, or use the admin token")
    return info


async def may_sample(farm, ref: P.AdapterRef | None, who: Principal) -> None:
    """404 unless `who` may sample from the adapter `ref` names (another tenant's is as unknown)."""
    if ref is not None and await _own(farm, ref.name, who, change=False) is None:
        raise not_found(ref.name)


@router.post(
    "/v1/adapters/{name}", response_model=P.AdapterPushResponse, responses=ERRORS, openapi_extra=SAFETENSORS_BODY
)
async def push_adapter(
    request: Request,
    name: str = NAME,
    version: int = Query(..., ge=1, le=P.INT64_MAX, description="The new version; never reused for other bytes."),
    who: Principal = Depends(require_caller),
    farm=Depends(ingress),
):
    """Upload a peft LoRA adapter as `name@v{version}`: its adapter_model.safetensors, with adapter_config.json in
    the header's `__metadata__` under "adapter_config" (the client's push_adapter does it). Checked against the
    served model, staged on every replica, committed on all or none; the answer's digest is the policy digest each
    sample from it carries. A tenant's first push makes the adapter its own."""
    await _own(farm, name, who, change=True)
    declared = int(request.headers.get("content-length") or 0)
    return await farm.adapter_push.upload(name, version, request.stream(), declared, who)


@router.post("/v1/adapters/{name}/path", response_model=P.AdapterPushResponse, responses=ERRORS)
async def push_adapter_path(
    body: P.AdapterFromPath, name: str = NAME, who: Principal = Depends(require_caller), farm=Depends(ingress)
):
    """Push a peft adapter folder every replica can read (adapter_config.json, adapter_model.safetensors)."""
    await _own(farm, name, who, change=True)
    return await farm.adapter_push.from_path(name, body, who)


@router.get("/v1/adapters", response_model=P.AdapterList)
async def list_adapters(who: Principal = Depends(caller), farm=Depends(ingress)):
    """The adapters the caller may use: a tenant's own and the admin's; the admin sees all."""
    return P.AdapterList(adapters=[a for a in await farm.adapters.all() if who.may_use(a.owner)])


@router.get("/v1/adapters/{name}", response_model=P.AdapterInfo, responses=ERRORS)
async def get_adapter(name: str = NAME, who: Principal = Depends(caller), farm=Depends(ingress)):
    """One adapter: its versions (resident or evicted), its owner, and the versions each replica holds now."""
    info = await _own(farm, name, who, change=False)
    if info is None:
        raise not_found(name)
    found = await farm.replicas.survey("resident_adapters")
    info.resident = {
        replica: sorted(int(k.rsplit("@v", 1)[1]) for k in keys if k.rsplit("@v", 1)[0] == name)
        for replica, keys in found.answers
    }
    return info


@router.delete("/v1/adapters/{name}", response_model=P.AdapterInfo, responses=ERRORS)
async def retire_adapter(name: str = NAME, who: Principal = Depends(require_caller), farm=Depends(ingress)):
    """Retire every resident version: requests for them are refused from now on, and each replica unloads a version
    once no running request uses it. The record stays: its versions are never reused."""
    if await _own(farm, name, who, change=True) is None:
        raise not_found(name)
    await farm.adapter_push.retire(name)
    return await farm.adapters.info(name)
