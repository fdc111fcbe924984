"""The pull-mode trajectory queue: prompt sources, pulls (leases) and acks. Everything but listing needs the token."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request

from rollout_farm.services import protocol as P
from rollout_farm.services.api.deps import ingress
from rollout_farm.services.api.uploads import prompts_from_body, read_body

router = APIRouter(tags=["queue"])
admin = APIRouter(tags=["queue"])  # needs the token
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
async def queue_sources(farm=Depends(ingress)):
    """Every source: queued prompts, ready and leased groups, acks, redeliveries and stale drops."""
    return await farm.queue.states()


@admin.post(
    "/v1/queue/sources",
    response_model=P.QueueSourceState,
    responses={code: {"model": P.ErrorResponse} for code in (404, 409, 422)},
)
async def queue_add_source(spec: P.QueueSource, farm=Depends(ingress)):
    """Register a prompt source; the service starts generating groups from it in the background (from `adapter`, a
    LoRA adapter, when it names one: every group's samples carry its policy)."""
    await farm.checks.rollout(spec)
    if spec.adapter is not None:
        await farm.adapters.resolve(spec.adapter)  # an unknown adapter is a 404 now, not a failing source later
    if spec.episodes is not None:
        farm.episodes.environment(spec.episodes.env, "episodes.env")
    return await farm.queue.add_source(spec)


@admin.delete(
    "/v1/queue/sources/{name}", response_model=P.QueueSourceState, responses={404: {"model": P.ErrorResponse}}
)
async def queue_remove_source(name: str, farm=Depends(ingress)):
    """Stop a source and forget its groups (leased ones included)."""
    return await farm.queue.remove(name)


@admin.post(
    "/v1/queue/sources/{name}/prompts",
    response_model=P.QueueSourceState,
    openapi_extra=JSONL_BODY,
    responses={code: {"model": P.ErrorResponse} for code in (404, 413, 422)},
)
async def queue_add_prompts(
    request: Request,
    name: str,
    batch_id: str | None = Query(
        None,
        pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
        description="Makes the addition idempotent: a second addition with the same batch_id adds nothing.",
    ),
    farm=Depends(ingress),
):
    """Add prompts to a source: a JSON QueuePrompts body, or an uploaded JSONL file (Content-Type
    application/x-ndjson), one Prompt per line."""
    body, _ = await read_body(
        request, farm.settings.max_upload_bytes, "FARM_MAX_UPLOAD_BYTES", "body", "send the prompts in parts"
    )
    prompts = prompts_from_body(body, request.headers.get("content-type"))
    await farm.checks.added_prompts((await farm.queue.get(name))[0], prompts)
    return await farm.queue.add_prompts(name, prompts, batch_id)


@admin.post(
    "/v1/queue/pull", response_model=P.PullResponse, responses={code: {"model": P.ErrorResponse} for code in (404, 422)}
)
async def queue_pull(req: P.PullRequest, farm=Depends(ingress)):
    """Lease up to max_groups ready groups (waiting up to wait_s for one). Ack them before lease_s runs out, or they
    are delivered again (same item_id). Groups older than max_staleness versions are dropped and generated again."""
    return await farm.queue.pull(req)


@admin.post("/v1/queue/ack", response_model=P.AckResponse)
async def queue_ack(req: P.AckRequest, farm=Depends(ingress)):
    """Settle groups the trainer has used; they are never delivered again. Acking twice is harmless."""
    return await farm.queue.ack(req.item_ids)
