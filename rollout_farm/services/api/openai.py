"""OpenAI-compatible models, completions and chat completions, for evaluation and agent tools (the openai SDK,
lm-eval and similar)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from rollout_farm.services import protocol as P
from rollout_farm.services.api.deps import ingress
from rollout_farm.services.compat.openai_stream import events

router = APIRouter(tags=["openai"])
ANSWERS = {422: {"model": P.ErrorResponse}, 200: {"content": {"text/event-stream": {}}}}


def answer(out: dict, req: P.CompletionRequest | P.ChatCompletionRequest):
    if not req.stream:
        return out
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(events(out, usage), media_type="text/event-stream")


@router.get("/v1/models")
async def models(farm=Depends(ingress)):
    """The served policy, with its committed weight version and context length under `meta`."""
    return await farm.openai.models()


@router.post("/v1/completions", responses=ANSWERS)
async def completions(req: P.CompletionRequest, farm=Depends(ingress)):
    """OpenAI-compatible text completion by the current policy (`stream` for server-sent events)."""
    return answer(await farm.openai.completions(req), req)


@router.post("/v1/chat/completions", responses=ANSWERS)
async def chat_completions(req: P.ChatCompletionRequest, farm=Depends(ingress)):
    """OpenAI-compatible chat completion; the messages go through the model's chat template."""
    return answer(await farm.openai.chat(req), req)
