"""Tinker's sampling API (the `tinker` SDK 0.38.0, docs/tenants.md): the requests its SamplingClient sends and the
answers it reads, under /api/v1. A sample's result is not JSON: it is a protobuf SampleResponse
(rollout_farm/services/compat/tinker_proto.py).

Names and defaults are Tinker's. The setup calls (sessions, sampling sessions, futures) ignore fields they do not use:
those carry the SDK's bookkeeping, not what is sampled. A sample request refuses every field the farm does not
serve (top-k logprobs, target or alternative prompt tokens, stability records) with a 422 naming it, never ignores
it.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rollout_farm.services.protocol.common import (
    MAX_N,
    MAX_NEW_TOKENS,
    MAX_STOPS,
    Float,
    Int64,
    NonEmptyText,
    RequestModel,
    Temperature,
    Text,
    TokenId,
)

TINKER_SCHEME = "tinker://"
MODEL_PATH = re.compile(r"^tinker://[A-Za-z0-9][A-Za-z0-9._-]{0,63}(@v[0-9]{1,18})?$")  # `name@vN` or `name`


class SetupRequest(RequestModel):
    """A setup call's body: what is not a field here is the SDK's bookkeeping (tags, metadata, versions), ignored."""

    model_config = ConfigDict(extra="ignore")


class SessionRef(SetupRequest):
    """POST /api/v1/session_heartbeat."""

    session_id: Text = Field(..., min_length=1, max_length=200, description="The session create_session made.")


class CreateSamplingSession(SetupRequest):
    """POST /api/v1/create_sampling_session: the policy a SamplingClient samples from."""

    session_id: Text = Field(..., min_length=1, max_length=200, description="The session create_session made.")
    sampling_session_seq_id: Int64 = Field(..., ge=0, description="The SDK's count of its sampling clients.")
    model_path: Text | None = Field(
        None,
        description="A LoRA adapter: 'tinker://<name>@v<N>' (that version) or 'tinker://<name>' (its newest resident "
        "version now, kept by this sampling session).",
    )
    base_model: Text | None = Field(None, description="The served model (GET /api/v1/get_server_capabilities).")

    @field_validator("model_path")
    @classmethod
    def _an_adapter(cls, v: str | None) -> str | None:
        if v is not None and not MODEL_PATH.match(v):
            raise ValueError(
                f"{v!r} names no farm adapter: give 'tinker://<adapter>@v<N>' or 'tinker://<adapter>' (its newest "
                "resident version); Tinker's checkpoint paths are not served"
            )
        return v


class EncodedText(RequestModel):
    """A prompt chunk of token ids: the only kind of chunk the farm serves."""

    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[TokenId] = Field(..., description="Token ids, in order.")


class ModelInput(RequestModel):
    chunks: list[EncodedText] = Field(..., min_length=1, description="The prompt's chunks, concatenated in order.")

    @field_validator("chunks", mode="before")
    @classmethod
    def _text_only(cls, v):
        for i, chunk in enumerate(v if isinstance(v, list) else []):
            kind = chunk.get("type") if isinstance(chunk, dict) else None
            if kind not in (None, "encoded_text"):
                raise ValueError(f"chunk {i} is {kind!r}: the farm serves token ids only (encoded_text chunks)")
        return v


class SamplingParams(RequestModel):
    """Tinker's sampling params, in the farm's ranges (a 422 names the field)."""

    max_tokens: int | None = Field(
        None, ge=1, le=MAX_NEW_TOKENS, description="Most tokens per sample; null: the farm's default (128)."
    )
    seed: Int64 | None = Field(None, ge=0, description="Seed for reproducible sampling of an identical request.")
    stop: NonEmptyText | list[NonEmptyText] | list[TokenId] | None = Field(
        None,
        description="null: stop at EOS. Strings or token ids: stop at those alone (EOS only if listed). []: never "
        "stop before max_tokens.",
    )
    temperature: Temperature = Field(1.0, ge=0.0, le=100.0)
    top_k: Int64 = Field(-1, ge=-1, description="-1 keeps every token; 0 is refused.")
    top_p: Float = Field(1.0, gt=0.0, le=1.0)

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k=0 keeps no token: use -1 to keep all, or a positive k")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        strings = [v] if isinstance(v, str) else [s for s in v or [] if isinstance(s, str)]
        if any(not s for s in strings):
            raise ValueError("a stop string is empty: remove it")
        if len(strings) > MAX_STOPS:
            raise ValueError(f"{len(strings)} stop strings: give at most {MAX_STOPS}")
        return v


NOT_SERVED = {  # what a sample request may ask that rollout-farm does not serve, and the fix
    "topk_prompt_logprobs": "top-k prompt logprobs are not served by rollout-farm: send 0",
    "topk_sample_logprobs": "top-k sample logprobs are not served by rollout-farm: send 0 (each sampled token's "
    "own logprob is always returned)",
    "prompt_alt_tokens_k": "alternative prompt tokens are not served by rollout-farm: send 0",
    "target_prompt_logprobs": "target prompt logprobs are not served by rollout-farm: leave them out (the prompt's "
    "own logprobs are: prompt_logprobs)",
    "record_stability_info": "stability records (for Tinker's training) are not served by rollout-farm: send false",
}


class SampleRequest(RequestModel):
    """POST /api/v1/asample: samples from a sampling session's policy (compute_logprobs is one too: max_tokens 1 and
    prompt_logprobs)."""

    sampling_session_id: Text = Field(..., min_length=1, max_length=200, description="create_sampling_session's id.")
    seq_id: Int64 = Field(..., ge=0, description="The SDK's count of its requests; a resubmission repeats it.")
    num_samples: int = Field(1, ge=1, le=MAX_N, description=f"Samples of the prompt, 1..{MAX_N}.")
    prompt: ModelInput
    sampling_params: SamplingParams
    prompt_logprobs: bool | None = Field(None, description="Also return each prompt token's logprob.")
    prompt_logprobs_last_n: Int64 | None = Field(None, ge=1, description="Score only the prompt's last N tokens.")
    topk_prompt_logprobs: int = Field(0, description="Refused unless 0.")
    topk_sample_logprobs: int = Field(0, description="Refused unless 0.")
    prompt_alt_tokens_k: int = Field(0, description="Refused unless 0.")
    target_prompt_logprobs: dict | None = Field(None, description="Refused unless absent.")
    record_stability_info: bool | None = Field(None, description="Refused when true (it serves training).")
    type: Literal["sample"] = "sample"

    @field_validator(*NOT_SERVED)
    @classmethod
    def _not_served(cls, v, info: ValidationInfo):
        if v:
            raise ValueError(NOT_SERVED[info.field_name])
        return v


class FutureRef(SetupRequest):
    """POST /api/v1/retrieve_future (and cancel_future)."""

    request_id: Text = Field(..., min_length=1, max_length=300, description="asample's request_id.")


class ClientConfig(BaseModel):
    """POST /api/v1/client/config: the SDK's switches, set so that it uses only the calls served here."""

    pjwt_auth_enabled: bool = False  # the key itself is sent (X-API-Key), never exchanged for a JWT
    use_pyqwest_transport: bool = False  # plain httpx
    sample_use_retrieve_futures: bool = False  # one retrieve_future per sample, not the batched call
    sample_join_sampling_session: bool = False  # no server-allocated clone ids


class CreateSessionResponse(BaseModel):
    type: Literal["create_session"] = "create_session"
    session_id: str = Field(..., description="A new session: the namespace of its sampling sessions.")


class CreateSamplingSessionResponse(BaseModel):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str = Field(..., description="'<session_id>:sample:<seq_id>'.")


class Sampler(BaseModel):
    """GET /api/v1/samplers/{id}, and the record kept in Redis (with its owner)."""

    sampler_id: str = Field(..., description="The sampling session's id.")
    base_model: str = Field(..., description="The served model (FARM_MODEL): the SDK loads its tokenizer by it.")
    model_path: str | None = Field(None, description="'tinker://<name>@v<N>': the adapter version it samples from.")


class FutureHandle(BaseModel):
    """asample's answer: the future to poll, and the id of each sample it will hold."""

    request_id: str = Field(..., description="'<sampling_session_id>:<seq_id>'.")
    sample_sequence_ids: list[str] = Field(..., description="One per sample: '<request_id>:<i>'.")


class TryAgain(BaseModel):
    """retrieve_future's answer while the sample runs (after holding the request up to ~25 s)."""

    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active"] = "active"


class RequestFailed(BaseModel):
    """retrieve_future's answer for a sample that failed: the SDK raises RequestFailedError, and does not retry."""

    error: str = Field(..., description="What went wrong and how to fix it.")
    category: Literal["user", "server"] = Field(..., description="'user': the request; 'server': the farm.")


class ModelCapability(BaseModel):
    model_name: str
    max_context_length: int | None = None
    trainable: bool = False
    sampleable: bool = True


class Capabilities(BaseModel):
    """GET /api/v1/get_server_capabilities: the one served model, sampleable, not trainable."""

    supported_models: list[ModelCapability]


class Accepted(BaseModel):
    """POST /api/v1/telemetry: dropped, answered at once."""

    status: Literal["accepted"] = "accepted"
