"""GET /v1/samplers, and the policy statistics the trainer reports for the samplers."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from rollout_farm.services import protocol as P
from rollout_farm.services.api.deps import ingress
from rollout_farm.services.extensions import samplers

router = APIRouter(tags=["samplers"])
admin = APIRouter(tags=["samplers"])  # needs the token


@router.get("/v1/samplers")
async def list_samplers() -> dict[str, str]:
    """Registered samplers and what each does."""
    return samplers.describe()


@router.get("/v1/policy_stats", response_model=P.PolicyStats)
async def policy_stats(farm=Depends(ingress)):
    """The statistics the trainer last reported."""
    return await farm.policy.refresh()


@admin.post("/v1/policy_stats", response_model=P.PolicyStats, responses={422: {"model": P.ErrorResponse}})
async def report_policy_stats(stats: P.PolicyStats, farm=Depends(ingress)):
    """The trainer reports its policy statistics; samplers read them from the next request on.
    Fields left out keep their last value."""
    return await farm.policy.report(stats)
