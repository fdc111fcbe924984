"""Anthropic's Messages API on a session, for Anthropic-API agents unmodified: the official SDK works with
`anthropic.Anthropic(base_url=f"{session_base_url}/anthropic", api_key=<token>)`. Each call is one chat turn of the
session (rollout_farm/services/compat/anthropic.py): the same tokens, loss mask, forks and retries as the session's
chat/completions. Errors are the farm's body (the SDK raises its class for the status and keeps the body)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from rollout_farm.services import protocol as P
from rollout_farm.services.api.deps import caller, ingress
from rollout_farm.services.api.sessions import chat_turn
from rollout_farm.services.compat import anthropic
from rollout_farm.services.compat.anthropic_stream import events
from rollout_farm.services.protocol import anthropic as A
from rollout_farm.services.tenants.registry import Principal

WHO = Depends(caller)
ERRORS = {code: {"model": P.ErrorResponse} for code in (404, 409, 422, 429)}
router = APIRouter(tags=["sessions"])


@router.post(
    "/v1/sessions/{session_id}/anthropic/v1/messages",
    responses={**ERRORS, 200: {"content": {"application/json": {}, "text/event-stream": {}}}},
)
async def messages(session_id: str, req: A.MessagesRequest, who: Principal = WHO, farm=Depends(ingress)):
    """One turn of the session as an Anthropic Message (`stream`: Anthropic's server-sent events); the farm's token
    view of the turn under `farm`."""
    chat = anthropic.chat_request(req)
    out = await chat_turn(farm, session_id, chat, who, anthropic.renamed_error)
    answer = anthropic.message(out, req)
    return StreamingResponse(events(answer), media_type="text/event-stream") if req.stream else answer


@router.post("/v1/sessions/{session_id}/anthropic/v1/messages/count_tokens", responses=ERRORS)
async def count_tokens(session_id: str, req: A.CountTokensRequest, who: Principal = WHO, farm=Depends(ingress)):
    """`input_tokens`: the history and tools through the model's chat template (compat/anthropic.py)."""
    await farm.sessions.load(session_id, who)  # 404 for no such session, or another tenant's
    return await anthropic.count_tokens(await farm.sessions.renderer.loaded(), req)
