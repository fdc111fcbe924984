"""POST /v1/rollouts (JSON or NDJSON stream) and DELETE /v1/rollouts/{request_id} (?partial=true: with what it
generated). A tenant's request_ids are its own (rollout_farm/services/rollout/jobs.py, owned())."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse

from rollout_farm.services import protocol as P
from rollout_farm.services.api.adapters import may_sample
from rollout_farm.services.api.deps import (
    admitted_stream,
    caller,
    generated_tokens,
    group_line_tokens,
    ingress,
    require_caller,
)
from rollout_farm.services.rollout.jobs import owned
from rollout_farm.services.tenants.registry import Principal

ERRORS = {code: {"model": P.ErrorResponse} for code in (404, 409, 422, 429)}
router = APIRouter(tags=["rollouts"])
admin = APIRouter(tags=["rollouts"])  # none needs the admin token alone: a tenant's token cancels its own rollouts


@router.post("/v1/rollouts", response_model=P.RolloutResponse, responses=ERRORS)
async def rollouts(req: P.RolloutRequest, who: Principal = Depends(caller), farm=Depends(ingress)):
    """Generate `n` samples for each prompt and score them; one group per prompt, in order.

    With `stream`, the answer is NDJSON: a GroupEvent line per group as it finishes, then a StreamEnd line.
    With a `request_id`, a repeat of the same request (also one still running) gets the first
    result back and generates nothing; the same id with a different body gets 409. A tenant's request_ids are its
    own: another tenant's same id is another request.
    DELETE /v1/rollouts/{request_id} cancels it, and so does the last waiting caller closing its connection.
    With `adapter`, the samples come from that LoRA adapter (the caller's own, or the admin's), each carrying its
    policy digest. A tenant's request past its quota or fair share is a 429 naming it (docs/tenants.md).
    """
    await may_sample(farm, req.adapter, who)
    if who.tenant and req.request_id:
        req = req.model_copy(update={"request_id": owned(req.request_id, who.tenant)})
    samples = len(req.prompts) * req.n  # what counts against the caller's tenant quota and fair share
    if req.stream:
        lines = await admitted_stream(farm, who, samples, lambda: farm.rollouts.stream(req), group_line_tokens)
        return StreamingResponse(lines, media_type="application/x-ndjson")
    async with farm.tenants.admitted(who, samples) as took:
        out = await farm.rollouts.answer(req)
        took(generated_tokens(out.groups))
    return out


@router.delete(
    "/v1/rollouts/{request_id}",
    response_model=P.CancelResponse,
    response_model_exclude_none=True,
    responses={401: {"model": P.ErrorResponse}},
)
async def cancel_rollout(
    request_id: str,
    partial: bool = Query(
        False,
        description="Answer with what the rollout generated up to the cut (`groups`), for a trainer to recycle: "
        "its samples cut short finish 'abort' with their tokens, logprobs and per-token weight versions so far.",
    ),
    who: Principal = Depends(require_caller),
    farm=Depends(ingress),
):
    """Cancel a running rollout by its request_id; its engine work stops at the next token. With `partial`, the
    rollout answers with what it generated (its own caller gets the same answer), and so does this DELETE. A
    tenant's token cancels only its own rollouts (another's id is one of its own that does not run: cancelled false);
    the admin's, any rollout of that id (its own, anyone's, and every tenant's)."""
    cancelled, groups = False, []
    for key in await keys(farm, request_id, who):
        if not partial:
            cancelled |= (await farm.rollouts.cancel(key)).cancelled
            continue
        cut, got = await farm.rollouts.jobs.cut(key, lambda key=key: farm.replicas.all("cut_rollout", key))
        cancelled, groups = cancelled or cut, groups + (got or [] if cut else [])
    answered = groups if partial and cancelled else None  # every cut rollout's groups, in the order of keys()
    return P.CancelResponse(request_id=request_id, cancelled=cancelled, groups=answered)


async def keys(farm, request_id: str, who: Principal) -> list[str]:
    """The ids the caller's request_id may name: a tenant's own; for the admin, its own and every tenant's."""
    if not who.admin:
        return [owned(request_id, who.tenant)]
    return [request_id, *(owned(request_id, t["tenant"]) for t in await farm.tenants.all())]
