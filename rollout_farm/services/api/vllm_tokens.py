"""vLLM's token route, POST /inference/v1/generate: token ids in, token ids and logprobs out, as vLLM's
token-in-token-out server answers (rollout_farm/services/compat/vllm_tokens.py), for token-level clients written for
vLLM (verifiers' training client)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from rollout_farm.services import protocol as P
from rollout_farm.services.api.deps import caller, ingress
from rollout_farm.services.protocol.vllm_tokens import GenerateTokensRequest
from rollout_farm.services.tenants.registry import Principal

router = APIRouter(tags=["vllm"])
ERRORS = {code: {"model": P.ErrorResponse} for code in (404, 422, 429)}


@router.post("/inference/v1/generate", responses=ERRORS)
async def generate(req: GenerateTokensRequest, who: Principal = Depends(caller), farm=Depends(ingress)):
    """One prompt's token ids, `sampling_params.n` samples: each choice's `token_ids` (the stop token included) and,
    with `sampling_params.logprobs`, one logprob entry per token (`"token": "token_id:N"` and `"token_id": N`)."""
    async with farm.tenants.admitted(who, req.sampling_params.n) as took:
        out = await farm.vllm_tokens.generate(req, who)
        took(out["usage"]["completion_tokens"])
    return out


@router.post("/v1/sessions/{session_id}/inference/v1/generate", responses={**ERRORS, 409: {"model": P.ErrorResponse}})
async def session_generate(
    session_id: str, req: GenerateTokensRequest, who: Principal = Depends(caller), farm=Depends(ingress)
):
    """The same route on a session (a vLLM client with the session's base URL): the whole prompt's ids each turn; the
    session appends what follows its tokens, forks where the prompt leaves them, and answers an answered turn's
    prompt again with that turn. One sample (`n` 1); the choice's `farm` names the session, segment and turn."""
    async with farm.tenants.admitted(who, 1) as took:
        out = await farm.vllm_tokens.session_turn(farm.sessions, session_id, req, who)
        took(out["usage"]["completion_tokens"])
    return out
