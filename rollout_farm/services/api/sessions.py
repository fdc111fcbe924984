"""Sessions, token level: open, generate turn by turn, reward, close, read the trajectory; list and delete them
with the token. The work is rollout_farm/services/episodes/sessions.py."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, Request

from rollout_farm.services import protocol as P
from rollout_farm.services.api.adapters import may_sample
from rollout_farm.services.api.deps import caller, ingress
from rollout_farm.services.api.openai import answer
from rollout_farm.services.errors import Invalid
from rollout_farm.services.protocol import sessions as S
from rollout_farm.services.tenants.registry import Principal

WHO = Depends(caller)  # the admin, a tenant (who sees only its own sessions), or nobody

ERRORS = {code: {"model": P.ErrorResponse} for code in (404, 409, 422, 429)}
STREAMED = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}
router = APIRouter(tags=["sessions"])
admin = APIRouter(tags=["sessions"])  # needs the token


def root(request: Request) -> str:
    """The service's base URL as this client reached it (a session's base_url is under it)."""
    return str(request.base_url)


@router.post("/v1/sessions", response_model=S.SessionInfo, responses=ERRORS)
async def open_session(req: S.SessionCreate, request: Request, who: Principal = WHO, farm=Depends(ingress)):
    """Open a session: its sampling params, GRPO group, weight-version floor, LoRA adapter and tool-call format. A
    tenant's session is its own: another tenant's token gets a 404 on it."""
    await may_sample(farm, req.adapter, who)
    return await farm.sessions.open(req, root(request), who)


@router.get("/v1/sessions/{session_id}", response_model=S.SessionInfo, responses=ERRORS)
async def session_info(session_id: str, request: Request, who: Principal = WHO, farm=Depends(ingress)):
    return await farm.sessions.info(session_id, root(request), who)


@router.post("/v1/sessions/{session_id}/generate", response_model=S.SessionTurn, responses=ERRORS)
async def session_generate(session_id: str, req: S.SessionGenerate, who: Principal = WHO, farm=Depends(ingress)):
    """Token ids in, token ids out: append the ids, sample, append the sampled ids verbatim. A repeat of an answered
    `turn` gets its answer again; `offset` rewrites the session from that token in a new segment."""
    async with farm.tenants.admitted(who, 1) as took:
        out = await farm.sessions.generate(session_id, req, who)
        took(len(out.token_ids))
    return out


@router.post("/v1/sessions/{session_id}/chat/completions", responses={**ERRORS, **STREAMED})
async def session_chat(session_id: str, req: S.SessionChatRequest, who: Principal = WHO, farm=Depends(ingress)):
    """OpenAI chat with tools on the session's tokens: only the new messages are rendered, the sampled ids are kept
    verbatim, tool calls come back as `tool_calls`; a rewritten history forks. The session's base_url is an OpenAI
    base URL; `stream` answers in server-sent events."""
    return answer(await chat_turn(farm, session_id, req, who), req)


async def chat_turn(
    farm,
    session_id: str,
    req: S.SessionChatRequest,
    who: Principal,
    renamed: Callable[[Invalid], Invalid] | None = None,
) -> dict:
    """A session's chat turn, the caller's tenant admitted for it; a door's 422s with its own field names
    (`renamed`). The chat route's and every other door's (api/anthropic.py, api/responses.py)."""
    async with farm.tenants.admitted(who, 1) as took:
        try:
            out = await farm.sessions.chat(session_id, req, who=who)
        except Invalid as e:
            raise (renamed(e) if renamed else e) from None
        took(out["usage"]["completion_tokens"])
    return out


@router.post("/v1/sessions/{session_id}/reward", response_model=S.SessionInfo, responses=ERRORS)
async def session_reward(
    session_id: str, req: S.SessionReward, request: Request, who: Principal = WHO, farm=Depends(ingress)
):
    """A turn's reward, or the episode's (no turn)."""
    return await farm.sessions.reward(session_id, req, root(request), who)


@router.post("/v1/sessions/{session_id}/close", response_model=S.SessionInfo, responses=ERRORS)
async def session_close(session_id: str, request: Request, who: Principal = WHO, farm=Depends(ingress)):
    """No more turns; the trajectory stays readable until the session expires."""
    return await farm.sessions.close(session_id, root(request), who)


@router.get("/v1/sessions/{session_id}/trajectory", response_model=S.Trajectory, responses=ERRORS)
async def session_trajectory(session_id: str, who: Principal = WHO, farm=Depends(ingress)):
    """Every segment: token ids, loss mask (1 exactly on sampled tokens), logprobs, per-token weight versions, turns."""
    return await farm.sessions.trajectory(session_id, who)


@admin.get("/v1/sessions", response_model=S.SessionList)
async def list_sessions(farm=Depends(ingress)):
    return await farm.sessions.list()


@admin.delete("/v1/sessions/{session_id}", responses={404: {"model": P.ErrorResponse}})
async def delete_session(session_id: str, farm=Depends(ingress)) -> dict:
    return await farm.sessions.delete(session_id)
