"""OpenAI-compatible completions and chat completions, for evaluation tools (lm-eval and similar)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from services import protocol as P
from services.api.deps import ingress

router = APIRouter(tags=["openai"])


@router.post("/v1/completions", responses={422: {"model": P.ErrorResponse}})
async def completions(req: P.CompletionRequest, farm=Depends(ingress)):
    """OpenAI-compatible text completion by the current policy."""
    return await farm.openai.completions(req)


@router.post("/v1/chat/completions", responses={422: {"model": P.ErrorResponse}})
async def chat_completions(req: P.ChatCompletionRequest, farm=Depends(ingress)):
    """OpenAI-compatible chat completion; the messages go through the model's chat template."""
    return await farm.openai.chat(req)
