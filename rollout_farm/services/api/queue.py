"""The pull-mode trajectory queue: prompt sources, pulls (leases) and acks. Everything but listing needs a token, the
admin's or a tenant's; a tenant's sources are its own (rollout_farm/services/queue/trajectory_queue.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request

from rollout_farm.services import protocol as P
from rollout_farm.services.api.adapters import may_sample
from rollout_farm.services.api.deps import caller, ingress, require_caller
from rollout_farm.services.api.uploads import prompts_from_body, read_body
from rollout_farm.services.tenants.registry import Principal

router = APIRouter(tags=["queue"])  # the routes that change something take a token: require_caller (401 without)
admin = APIRouter(tags=["queue"])  # none needs the admin token alone now: a tenant's token works on its own sources
TOKEN = Depends(require_caller)


def errors(*codes: int) -> dict:
    return {code: {"model": P.ErrorResponse} for code in (401, *codes)}


# the route reads the body itself; QueuePrompts is added to the components in rollout_farm/services/api/__init__.py
JSONL_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/QueuePrompts"}},
            "application/x-ndjson": {"schema": {"type": "string", "description": "One Prompt per line (JSONL)"}},
        },
    }
}


@router.get("/v1/queue/sources", response_model=list[P.QueueSourceState])
async def queue_sources(who: Principal = Depends(caller), farm=Depends(ingress)):
    """The sources the caller may see: queued prompts, ready and leased groups, acks, redeliveries and stale drops.
    The admin's token sees every source, a tenant's its own; without a token, the admin's."""
    return await farm.queue.states(who)


@router.post("/v1/queue/sources", response_model=P.QueueSourceState, responses=errors(404, 409, 422))
async def queue_add_source(spec: P.QueueSource, who: Principal = TOKEN, farm=Depends(ingress)):
    """Register a prompt source, owned by the caller's tenant; the service starts generating groups from it in the
    background (from `adapter`, a LoRA adapter the caller may use, when it names one: every group's samples carry its
    policy). A name another tenant holds is a 409."""
    await farm.checks.rollout(spec)
    await may_sample(farm, spec.adapter, who)  # another tenant's adapter is as unknown: 404
    if spec.adapter is not None:
        await farm.adapters.resolve(spec.adapter)  # an unknown adapter is a 404 now, not a failing source later
    if spec.episodes is not None:
        await farm.episodes.environment(spec.episodes.env, "episodes.env")
    return await farm.queue.add_source(spec, who)


@router.delete("/v1/queue/sources/{name}", response_model=P.QueueSourceState, responses=errors(404))
async def queue_remove_source(name: str, who: Principal = TOKEN, farm=Depends(ingress)):
    """Stop one of the caller's sources and forget its groups (leased ones included)."""
    return await farm.queue.remove(name, who)


@router.post(
    "/v1/queue/sources/{name}/prompts",
    response_model=P.QueueSourceState,
    openapi_extra=JSONL_BODY,
    responses=errors(404, 413, 422),
)
async def queue_add_prompts(
    request: Request,
    name: str,
    batch_id: str | None = Query(
        None,
        pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
        description="Makes the addition idempotent: a second addition with the same batch_id adds nothing.",
    ),
    who: Principal = TOKEN,
    farm=Depends(ingress),
):
    """Add prompts to one of the caller's sources: a JSON QueuePrompts body, or an uploaded JSONL file (Content-Type
    application/x-ndjson), one Prompt per line."""
    body, _ = await read_body(
        request, farm.settings.max_upload_bytes, "FARM_MAX_UPLOAD_BYTES", "body", "send the prompts in parts"
    )
    prompts = prompts_from_body(body, request.headers.get("content-type"))
    await farm.checks.added_prompts((await farm.queue.get(name, who)).spec, prompts)
    return await farm.queue.add_prompts(name, prompts, batch_id, who)


@router.post("/v1/queue/pull", response_model=P.PullResponse, responses=errors(404, 422))
async def queue_pull(req: P.PullRequest, who: Principal = TOKEN, farm=Depends(ingress)):
    """Lease up to max_groups ready groups of one of the caller's sources (waiting up to wait_s for one). Ack them
    before lease_s runs out, or they are delivered again (same item_id). Groups older than max_staleness versions
    are dropped and generated again. Another tenant's source is a 404."""
    return await farm.queue.pull(req, who)


@router.post("/v1/queue/ack", response_model=P.AckResponse, responses=errors())
async def queue_ack(req: P.AckRequest, who: Principal = TOKEN, farm=Depends(ingress)):
    """Settle groups the trainer has used; they are never delivered again. Acking twice is harmless. The items of
    another tenant's source are `unknown`, and stay as they are."""
    return await farm.queue.ack(req.item_ids, who)
