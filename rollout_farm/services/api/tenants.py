"""Tenants and their tokens, for the admin only (`farm tenants create|list|revoke`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path

from rollout_farm.services import protocol as P
from rollout_farm.services.api.deps import ingress, require_token
from rollout_farm.services.tenants.registry import TENANT_ID

ERRORS = {code: {"model": P.ErrorResponse} for code in (401, 404, 422)}
TENANT = Path(..., pattern=TENANT_ID.pattern, description="The tenant's id (lower-case letters, digits, '-').")
router = APIRouter(tags=["tenants"], dependencies=[Depends(require_token)])


@router.post("/v1/tenants/{tenant}", response_model=P.TenantToken, responses=ERRORS)
async def create_tenant(tenant: str = TENANT, farm=Depends(ingress)):
    """Create the tenant, or give an existing one another token. The token is in this answer only: the farm keeps
    its SHA-256."""
    record, token = await farm.tenants.create(tenant)
    return P.TenantToken(tenant=tenant, token=token, tokens=len(record["tokens"]))


@router.get("/v1/tenants", response_model=P.TenantList, responses=ERRORS)
async def list_tenants(farm=Depends(ingress)):
    return P.TenantList(tenants=[info(t) for t in await farm.tenants.all()])


@router.put("/v1/tenants/{tenant}/quota", response_model=P.TenantInfo, responses=ERRORS)
async def set_quota(quota: P.TenantQuota, tenant: str = TENANT, farm=Depends(ingress)):
    """The tenant's limits (in-flight samples, tokens per second; unset: none) and its weight in a busy farm. A
    request past them is a 429 naming the tenant, with Retry-After."""
    t = await farm.tenants.set_quota(tenant, quota.model_dump())
    return info(t)


@router.delete("/v1/tenants/{tenant}", response_model=P.TenantInfo, responses=ERRORS)
async def revoke_tenant(tenant: str = TENANT, farm=Depends(ingress)):
    """Revoke every token of the tenant at once. Its adapters stay, for the admin to retire."""
    return info({**await farm.tenants.revoke(tenant), "tokens": []})


def info(record: dict) -> P.TenantInfo:
    quota = P.TenantQuota(**(record.get("quota") or {}))
    return P.TenantInfo(tenant=record["tenant"], created=record["created"], tokens=len(record["tokens"]), quota=quota)
