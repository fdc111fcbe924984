"""OpenAI-compatible models, completions and chat completions, for evaluation and agent tools (the openai SDK,
lm-eval and similar)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from rollout_farm.services import protocol as P
from rollout_farm.services.api.deps import caller, ingress
from rollout_farm.services.compat.openai_stream import events
from rollout_farm.services.tenants.registry import Principal

router = APIRouter(tags=["openai"])
ANSWERS = {code: {"model": P.ErrorResponse} for code in (404, 409, 422, 429)} | {
    200: {"content": {"text/event-stream": {}}}
}


def prompts(prompt) -> int:
    """How many prompts OpenAI's prompt field holds (a text, texts, token ids, or lists of them)."""
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1


def answer(out: dict, req: P.CompletionRequest | P.ChatCompletionRequest):
    if not req.stream:
        return out
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(events(out, usage), media_type="text/event-stream")


@router.get("/v1/models")
async def models(who: Principal = Depends(caller), farm=Depends(ingress)):
    """The base policy, with its committed weight version and context length under `meta`, then the resident
    versions of the LoRA adapters the caller may use ("name@vN")."""
    return await farm.openai.models(who)


@router.post("/v1/completions", responses=ANSWERS)
async def completions(req: P.CompletionRequest, who: Principal = Depends(caller), farm=Depends(ingress)):
    """OpenAI-compatible text completion by the current policy (`stream` for server-sent events); `model` may name a
    LoRA adapter ("name" or "name@vN"), and the answer's `model` names the policy that drew it."""
    async with farm.tenants.admitted(who, req.n * prompts(req.prompt)) as took:
        out = await farm.openai.completions(req, who)
        took(out["usage"]["completion_tokens"])
    return answer(out, req)


@router.post("/v1/chat/completions", responses=ANSWERS)
async def chat_completions(req: P.ChatCompletionRequest, who: Principal = Depends(caller), farm=Depends(ingress)):
    """OpenAI-compatible chat completion; the messages go through the model's chat template. `model` may name a LoRA
    adapter ("name" or "name@vN"), and the answer's `model` names the policy that drew it."""
    async with farm.tenants.admitted(who, req.n) as took:
        out = await farm.openai.chat(req, who)
        took(out["usage"]["completion_tokens"])
    return answer(out, req)
