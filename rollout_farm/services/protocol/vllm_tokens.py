"""vLLM's token route, POST /inference/v1/generate (vllm 0.31-0.34, entrypoints/.../token_in_token_out/protocol.py:
GenerateRequest), so that token-level clients written for vLLM (verifiers' training client, through `renderers`)
work against the farm with only the URL changed.

Field names and defaults are vLLM's. A field vLLM defines that the farm cannot honour is absent here, or accepted only
at a value the farm honours, so that it is refused with a 422 naming it (extra="forbid"), never ignored: vLLM itself
drops unknown sampling_params keys silently; the farm does not.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from rollout_farm.services.protocol.common import (
    MAX_N,
    MAX_NEW_TOKENS,
    MAX_STOPS,
    Float,
    Int64,
    NonEmptyIds,
    NonEmptyText,
    RequestModel,
    Temperature,
    Text,
    TokenId,
)


class VLLMSamplingParams(RequestModel):
    """vLLM's SamplingParams, the subset the farm's engines honour (the farm's SamplingParams underneath)."""

    n: int = Field(1, ge=1, le=MAX_N, description="Samples of the prompt.")
    temperature: Temperature = Field(1.0, ge=0.0, le=100.0, description="Softmax temperature; 0 means greedy.")
    top_p: Float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: Int64 = Field(0, ge=-1, description="Keep the k most likely tokens; 0 or -1 keeps all (vLLM's).")
    min_p: Literal[0, 0.0] = Field(0.0, description="Only 0: the farm's engines have no min-p sampling.")
    seed: Int64 | None = Field(None, ge=0, description="Seed for reproducible sampling.")
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_NEW_TOKENS, description="Most tokens to generate; None: up to the model's context."
    )
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = Field(
        None, description="Strings that end the sample."
    )
    stop_token_ids: list[TokenId] | None = Field(
        None, description="Token ids that end the sample, besides EOS; the stop token is in token_ids."
    )
    ignore_eos: bool = Field(False, description="Keep generating past EOS, up to max_tokens.")
    logprobs: Literal[0, 1] | None = Field(
        None,
        description="0 or 1: each generated token's logprob (the raw model's: log_softmax at temperature 1, as vLLM's "
        "default logprobs mode), its top_logprobs the sampled token alone; None: no logprobs.",
    )
    skip_special_tokens: bool = Field(True, description="vLLM's detokenizer option; this route returns no text.")
    spaces_between_special_tokens: bool = Field(True, description="As skip_special_tokens: no text is returned.")
    routed_experts_prompt_start: int = Field(
        0,
        ge=0,
        description="vLLM's: the prompt position the returned routed experts start at (verifiers 0.4.0's training "
        "client sends it on every turn its renderer bridges from the last one). Accepted: the farm's engines return no "
        "routed experts (each choice's routed_experts is null), as vLLM does without --enable-return-routed-experts.",
    )


class GenerateTokensRequest(RequestModel):
    """POST /inference/v1/generate: one prompt of token ids."""

    token_ids: NonEmptyIds = Field(..., description="The prompt's token ids.")
    sampling_params: VLLMSamplingParams = Field(default_factory=VLLMSamplingParams)
    model: Text | None = Field(None, description="The served model, or a LoRA adapter 'name@vN' / 'name' (/v1/models).")
    request_id: Text | None = Field(None, max_length=256, description="Echoed as the answer's request_id.")
    return_token_ids: bool | None = Field(None, description="Echo the prompt's ids as prompt_token_ids.")
    stream: Literal[False] = Field(False, description="Only false: POST /v1/rollouts streams groups.")
    cache_salt: Text | None = Field(
        None,
        max_length=1024,
        description="vLLM's prefix-cache isolation. Accepted: the farm shares no prefix cache between requests (a "
        "session's KV cache is its own), so every request is isolated already.",
    )
    priority: Literal[0] = Field(0, description="Only 0: the farm schedules by tenant fair share, not priority.")

    @field_validator("token_ids")
    @classmethod
    def some_tokens(cls, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("an empty prompt: give at least one token id")
        return ids
