"""OpenAI-compatible endpoints, for evaluation and agent tools (the openai SDK, lm-eval and similar).

Every field OpenAI defines that the service cannot honour is refused with a 422 naming it (extra="forbid"), never
ignored. Limits a model sets (its context) are checked when the request reaches it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from rollout_farm.services.protocol.common import (
    MAX_N,
    MAX_NEW_TOKENS,
    MAX_PROMPTS,
    MAX_STOPS,
    Float,
    Int64,
    NonEmptyIds,
    NonEmptyText,
    RequestModel,
    Temperature,
    Text,
)


class StreamOptions(RequestModel):
    include_usage: bool = Field(False, description="Send one last chunk with the usage block and no choices.")


class CompletionRequest(RequestModel):
    """POST /v1/completions."""

    # the service's rule, for the schema: max_tokens 0 only with echo
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
            "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]},
        }
    )

    model: Text | None = Field(
        None,
        description="A LoRA adapter, 'name@vN' or 'name' (its newest resident version; GET /v1/adapters), or any "
        "other name for the base model (GET /v1/models).",
    )
    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(max_length=MAX_PROMPTS, json_schema_extra={"minItems": 1})]
        | NonEmptyIds
        | Annotated[list[NonEmptyIds], Field(max_length=MAX_PROMPTS, json_schema_extra={"minItems": 1})]
    ) = Field(
        ...,
        description=f"A text, a list of texts, token ids, or a list of token-id lists (at most {MAX_PROMPTS} prompts).",
    )
    max_tokens: int = Field(16, ge=0, le=MAX_NEW_TOKENS, description="0 only with echo: score the prompt alone.")
    temperature: Temperature = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = Field(
        None, description="Up to 16 strings that end a choice inside the engine (the string is not returned)."
    )
    seed: Int64 | None = Field(None, ge=0)
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Logprobs of each token, and the top k alternatives at each position."
    )
    echo: bool = Field(False, description="Return the prompt before the completion (with its logprobs if asked).")
    stream: bool = Field(False, description="Server-sent events, OpenAI's chunk format, ending with [DONE].")
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, description="Accepted and logged nowhere (OpenAI's end-user id).")


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] = Field(..., description="Text, or text parts (other part types are refused).")
    name: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(RequestModel):
    """POST /v1/chat/completions; messages go through the model's chat template."""

    # the service's rule, for the schema: top_logprobs only with logprobs
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        }
    )

    model: Text | None = Field(
        None,
        description="A LoRA adapter, 'name@vN' or 'name' (its newest resident version; GET /v1/adapters), or any "
        "other name for the base model (GET /v1/models).",
    )
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_NEW_TOKENS, description="Deprecated OpenAI name of max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: Temperature = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = None
    seed: Int64 | None = Field(None, ge=0)
    logprobs: bool = Field(False, description="Return each sampled token's logprob.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs: the top k alternatives too.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    return_token_ids: bool | None = Field(
        None,
        description="vLLM's extension: the answer carries `prompt_token_ids` (the rendered prompt's ids) and each "
        "choice's `token_ids` (its sampled ids, the stop token included); streamed, on each choice's content chunk "
        "and the prompt's on the first chunk.",
    )
