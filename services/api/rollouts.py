"""POST /v1/rollouts (JSON or NDJSON stream) and DELETE /v1/rollouts/{request_id}."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from services import protocol as P
from services.api.deps import ingress

ERRORS = {code: {"model": P.ErrorResponse} for code in (409, 422, 429)}
router = APIRouter(tags=["rollouts"])
admin = APIRouter(tags=["rollouts"])  # needs the token


@router.post("/v1/rollouts", response_model=P.RolloutResponse, responses=ERRORS)
async def rollouts(req: P.RolloutRequest, farm=Depends(ingress)):
    """Generate `n` samples for each prompt and score them; one group per prompt, in order.

    With `stream`, the answer is NDJSON: a GroupEvent line per group as it finishes, then a StreamEnd line.
    With a `request_id`, a repeat of the same request (also one still running) gets the first
    result back and generates nothing; the same id with a different body gets 409.
    DELETE /v1/rollouts/{request_id} cancels it, and so does the last waiting caller closing its connection.
    """
    if req.stream:
        return StreamingResponse(await farm.rollouts.stream(req), media_type="application/x-ndjson")
    return await farm.rollouts.answer(req)


@admin.delete("/v1/rollouts/{request_id}", response_model=P.CancelResponse)
async def cancel_rollout(request_id: str, farm=Depends(ingress)):
    """Cancel a running rollout by its request_id; its engine work stops at the next token."""
    return await farm.rollouts.cancel(request_id)
