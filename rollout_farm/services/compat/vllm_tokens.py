"""vLLM's token route onto the farm's rollouts: POST /inference/v1/generate (token ids in; token ids and their logprobs
out, as vLLM answers), for clients written for vLLM's token-in-token-out server (verifiers' training client, through
`renderers`). The shapes: rollout_farm/services/protocol/vllm_tokens.py.

Each logprob entry carries both of vLLM's shapes: `"token": "token_id:N"` (vLLM <= 0.31, what `renderers` 0.1.12
checks) and `"token_id": N` with `rank` (vLLM >= 0.32's default output_mode "tokens"). The logprobs are the raw
model's (log_softmax at temperature 1), as vLLM's default logprobs mode returns them. Each choice also carries the
farm's own record of the policy that drew it (`farm`: weight version, per-token versions, adapter digest).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from pydantic import ValidationError

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import Invalid, pydantic_fields
from rollout_farm.services.protocol.common import MAX_NEW_TOKENS
from rollout_farm.services.protocol.vllm_tokens import GenerateTokensRequest, VLLMSamplingParams
from rollout_farm.services.tenants.registry import ANYONE, Principal

if TYPE_CHECKING:
    from rollout_farm.services.compat.openai_api import OpenAICompat
    from rollout_farm.services.episodes.sessions import Sessions
    from rollout_farm.services.protocol.sessions import SessionTurn


class VLLMTokens:
    def __init__(self, openai: OpenAICompat):
        self.openai = openai

    async def generate(self, req: GenerateTokensRequest, who: Principal = ANYONE) -> dict:
        adapter = await self.openai.policy(req.model, who)
        prompt = P.Prompt(token_ids=req.token_ids)
        max_tokens = await self.max_tokens(prompt, req.sampling_params)
        params = farm_params(req.sampling_params, max_tokens)
        rollout = await self.openai.generate([prompt], req.sampling_params.n, params, adapter)
        (group,) = rollout.groups
        choices = [choice(i, s, req.sampling_params) for i, s in enumerate(group.samples)]
        return answer(req, self.openai.served_as(rollout.adapter), choices)

    async def session_turn(
        self, sessions: Sessions, session_id: str, req: GenerateTokensRequest, who: Principal
    ) -> dict:
        """A session's turn from the whole prompt, as a vLLM client sends it: the session's head and more appends,
        a prompt that leaves the head forks where they part, an answered turn's prompt again is a retry
        (Sessions.tokens_turn). One sample; `model` is any name (the session's policy draws, as on its other doors)."""
        if req.sampling_params.n != 1:
            raise Invalid(
                [
                    {
                        "field": "sampling_params.n",
                        "message": "a session's turn samples one completion: give n=1 (a "
                        "group is a session per sample)",
                    }
                ]
            )
        prompt = P.Prompt(token_ids=req.token_ids)
        params = farm_params(req.sampling_params, await self.max_tokens(prompt, req.sampling_params))
        turn = await sessions.tokens_turn(session_id, list(req.token_ids), params, who)
        drew = (turn.policies or [None])[-1]
        model = f"{drew.adapter}@v{drew.adapter_version}" if drew and drew.adapter else self.openai.served_as(None)
        return answer(req, model, [turn_choice(turn, req.sampling_params)])

    async def max_tokens(self, prompt: P.Prompt, sp: VLLMSamplingParams) -> int:
        """max_tokens, or (vLLM's default) what the context leaves after the prompt; 422s name token_ids or
        sampling_params.max_tokens."""
        checks = self.openai.checks
        try:
            await checks.tokens([prompt])
            context = await checks.context_length()
            if sp.max_tokens is not None:
                wanted = sp.max_tokens
            elif context is None:
                wanted = MAX_NEW_TOKENS
            else:
                wanted = max(1, min(MAX_NEW_TOKENS, context - len(prompt.token_ids)))
            await checks.fits([prompt], wanted, "sampling_params.max_tokens", "token_ids")
        except Invalid as e:
            raise Invalid([{**d, "field": renamed(d["field"])} for d in e.detail], e.message) from None
        return wanted


def answer(req: GenerateTokensRequest, model: str, choices: list[dict]) -> dict:
    """vLLM's answer around the choices (every field present, as vLLM dumps it without exclude_none)."""
    completion = sum(len(c["token_ids"]) for c in choices)
    return {
        "request_id": f"generate-tokens-{req.request_id or uuid.uuid4().hex}",
        "model": model,
        "created": int(time.time()),
        "choices": choices,
        "usage": {
            "prompt_tokens": len(req.token_ids),
            "completion_tokens": completion,
            "total_tokens": len(req.token_ids) + completion,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": list(req.token_ids) if req.return_token_ids else None,
        "mm_placeholders": None,
        "kv_transfer_params": None,
    }


def renamed(field: str) -> str:
    """A rollout's field under this route's names."""
    if field.startswith(("prompts.0.token_ids", "token_ids.")):
        return "token_ids"
    return field


def farm_params(sp: VLLMSamplingParams, max_tokens: int) -> P.SamplingParams:
    try:
        return P.SamplingParams(
            max_new_tokens=max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=-1 if sp.top_k in (0, -1) else sp.top_k,
            seed=sp.seed,
            stop=[sp.stop] if isinstance(sp.stop, str) else list(sp.stop or []),
            stop_token_ids=sp.stop_token_ids or [],
            ignore_eos=sp.ignore_eos,
        )
    except ValidationError as e:
        raise Invalid(pydantic_fields(e.errors(), "sampling_params")) from None


def choice(index: int, s: P.Sample, sp: VLLMSamplingParams) -> dict:
    """One sample as vLLM's choice: its ids, the stop token included; logprobs in both of vLLM's entry shapes."""
    farm = {
        "weight_version": s.weight_version,
        "token_weight_versions": s.token_weight_versions,
        "policy": s.policy.model_dump() if s.policy else None,
    }
    return choice_of(index, s.token_ids, s.logprobs, s.finish_reason, sp, farm)


def turn_choice(turn: SessionTurn, sp: VLLMSamplingParams) -> dict:
    """A session's turn as vLLM's choice; `farm` also names the session, segment and turn (its trajectory's)."""
    farm = {
        "session_id": turn.session_id,
        "segment_id": turn.segment_id,
        "turn": turn.turn,
        "weight_version": turn.weight_version,
        "token_weight_versions": turn.token_weight_versions,
        "policies": [p.model_dump() for p in turn.policies or []],
    }
    return choice_of(0, turn.token_ids, turn.logprobs, turn.finish_reason, sp, farm)


def choice_of(index: int, ids: list[int], lps: list[float], finish: str, sp: VLLMSamplingParams, farm: dict) -> dict:
    stopped_by = ids[-1] if ids and ids[-1] in (sp.stop_token_ids or []) else None
    logprobs = None
    if sp.logprobs is not None:
        logprobs = {"content": [entry(t, lp, top=True) for t, lp in zip(ids, lps)]}
    return {
        "index": index,
        "token_ids": list(ids),
        "finish_reason": finish,
        "stop_reason": stopped_by,
        "logprobs": logprobs,
        "routed_experts": None,
        "sampling_mask": None,
        "farm": farm,
    }


def entry(token: int, logprob: float, top: bool) -> dict:
    out = {"token": f"token_id:{token}", "token_id": token, "logprob": logprob, "rank": None, "bytes": None}
    return out | {"top_logprobs": [entry(token, logprob, top=False)]} if top else out
