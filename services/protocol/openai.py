"""OpenAI-compatible endpoints, so evaluation tools (lm-eval and similar) can score the current policy."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from services.protocol.common import MAX_N, MAX_NEW_TOKENS


class CompletionRequest(BaseModel):
    """POST /v1/completions, the subset of OpenAI's fields that a local policy can honour."""

    model: str | None = Field(None, description="Ignored: the service serves one policy.")
    prompt: str | list[str] = Field(..., description="One prompt or several.")
    max_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(None, description="Text at which a choice ends (not included).")
    seed: int | None = Field(None, ge=0, lt=2**63)
    logprobs: int | None = Field(
        None, ge=0, le=0, description="0 returns the sampled tokens' logprobs; alternatives (1..5) are not available."
    )


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions; messages go through the model's chat template."""

    model: str | None = Field(None, description="Ignored: the service serves one policy.")
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_NEW_TOKENS, description="Deprecated OpenAI name of max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    logprobs: bool = Field(False, description="Return the sampled tokens' logprobs.")
    top_logprobs: int | None = Field(None, ge=0, le=0, description="Alternatives are not available: only 0.")
