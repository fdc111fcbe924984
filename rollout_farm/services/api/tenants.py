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
    return P.TenantList(
        tenants=[
            P.TenantInfo(tenant=t["tenant"], created=t["created"], tokens=len(t["tokens"]))
            for t in await farm.tenants.all()
        ]
    )


@router.delete("/v1/tenants/{tenant}", response_model=P.TenantInfo, responses=ERRORS)
async def revoke_tenant(tenant: str = TENANT, farm=Depends(ingress)):
    """Revoke every token of the tenant at once. Its adapters stay, for the admin to retire."""
    t = await farm.tenants.revoke(tenant)
    return P.TenantInfo(tenant=t["tenant"], created=t["created"], tokens=0)
