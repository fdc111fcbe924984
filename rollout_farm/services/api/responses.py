"""OpenAI's Responses API on a session, for Responses agents unmodified (the OpenAI Agents SDK, Codex-style agents):
served under the session's base_url (`OpenAI(base_url=session_base_url)`: the same base URL as its chat
completions) and under `{base_url}/v1`, the route the issue names. Each call is one chat turn of the session
(rollout_farm/services/compat/responses.py): the same tokens, loss mask, forks and retries as chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from rollout_farm.services import protocol as P
from rollout_farm.services.api.deps import caller, ingress
from rollout_farm.services.api.sessions import chat_turn
from rollout_farm.services.compat import responses
from rollout_farm.services.compat.responses_stream import events
from rollout_farm.services.protocol import responses as R
from rollout_farm.services.tenants.registry import Principal

WHO = Depends(caller)
ANSWERS = {code: {"model": P.ErrorResponse} for code in (404, 409, 422, 429)} | {
    200: {"content": {"application/json": {}, "text/event-stream": {}}}
}
router = APIRouter(tags=["sessions"])


@router.post("/v1/sessions/{session_id}/v1/responses", responses=ANSWERS)
@router.post("/v1/sessions/{session_id}/responses", responses=ANSWERS)
async def create_response(session_id: str, req: R.ResponsesRequest, who: Principal = WHO, farm=Depends(ingress)):
    """One turn of the session as a Response (`stream`: OpenAI's server-sent events); previous_response_id names a
    response of this session; the farm's token view of the turn under `farm`."""
    history = []
    if req.previous_response_id is not None:
        history = responses.previous(await farm.sessions.load(session_id, who), req.previous_response_id)
    chat = responses.chat_request(req, history)
    out = await chat_turn(farm, session_id, chat, who, responses.renamed_error)
    answer = responses.response(out, req)
    return StreamingResponse(events(answer), media_type="text/event-stream") if req.stream else answer
