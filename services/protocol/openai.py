"""OpenAI-compatible endpoints, for evaluation and agent tools (the openai SDK, lm-eval and similar).

Every field OpenAI defines that the service cannot honour is refused with a 422 naming it (extra="forbid"), never
ignored. Limits a model sets (its context) are checked when the request reaches it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.protocol.common import MAX_N, MAX_NEW_TOKENS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="Send one last chunk with the usage block and no choices.")


class CompletionRequest(_Strict):
    """POST /v1/completions."""

    model: str | None = Field(None, description="Any name: the service serves one policy (see GET /v1/models).")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="A text, a list of texts, token ids, or a list of token-id lists."
    )
    max_tokens: int = Field(16, ge=0, le=MAX_NEW_TOKENS, description="0 only with echo: score the prompt alone.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(
        None, description="Up to 4 strings that end a choice inside the engine (the string is not returned)."
    )
    seed: int | None = Field(None, ge=0, lt=2**63)
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Logprobs of each token, and the top k alternatives at each position."
    )
    echo: bool = Field(False, description="Return the prompt before the completion (with its logprobs if asked).")
    stream: bool = Field(False, description="Server-sent events, OpenAI's chunk format, ending with [DONE].")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="Accepted and logged nowhere (OpenAI's end-user id).")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(..., description="Text, or text parts (other part types are refused).")
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Strict):
    """POST /v1/chat/completions; messages go through the model's chat template."""

    model: str | None = Field(None, description="Any name: the service serves one policy (see GET /v1/models).")
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
    logprobs: bool = Field(False, description="Return each sampled token's logprob.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs: the top k alternatives too.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
