"""Wire contracts of the rollout service, shared by the service and the client.

Only data lives here: request and response models with a comment on each field.
Field names follow SGLang's sampling params (temperature, top_p, top_k,
max_new_tokens, stop_token_ids, seed) so that users of SGLang recognise them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

API_VERSION = "v1"
MAX_N = 64  # most samples per prompt in one request
MAX_PROMPTS = 512  # most prompts in one request
MAX_NEW_TOKENS = 4096  # most tokens one sample may generate

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(BaseModel):
    """How each sample is drawn. Logprobs are always those of the raw model (see README)."""

    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Softmax temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens; -1 keeps all.")
    max_new_tokens: int = Field(128, ge=1, le=MAX_NEW_TOKENS, description="Most tokens to generate per sample.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra token ids that end a sample (EOS always does).")
    ignore_eos: bool = Field(False, description="Keep generating past EOS, up to max_new_tokens (stop_token_ids still stop).")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Seed for reproducible sampling of an identical request.")

    @model_validator(mode="after")
    def _top_k_not_zero(self) -> "SamplingParams":
        if self.top_k == 0:
            raise ValueError("top_k=0 keeps no token: use -1 to keep all, or a positive k")
        return self


class Prompt(BaseModel):
    """One prompt: either text or token ids, plus what the reward function compares with."""

    text: str | None = Field(None, description="Prompt text; tokenized by the service without special tokens.")
    token_ids: list[int] | None = Field(None, description="Prompt token ids; used instead of text.")
    ground_truth: str | None = Field(None, description="Reference answer handed to the reward function.")

    @model_validator(mode="after")
    def _exactly_one(self) -> "Prompt":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'text' or 'token_ids'")
        if self.text is not None and not self.text:
            raise ValueError("text is empty: give a non-empty prompt")
        if self.token_ids is not None and not self.token_ids:
            raise ValueError("token_ids is empty: give at least one token id")
        return self


class RolloutRequest(BaseModel):
    """POST /v1/rollouts: n samples for each prompt, scored by a reward function."""

    prompts: list[Prompt] = Field(..., min_length=1, max_length=MAX_PROMPTS, description="The prompts, one group each.")
    n: int = Field(1, ge=1, le=MAX_N, description=f"Samples per prompt, 1..{MAX_N}.")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams, description="Shared by every sample.")
    reward: str | None = Field(None, description="Registered reward function name, or none for reward 0.")
    request_id: str | None = Field(None, min_length=1, max_length=128,
                                   description="Idempotency key: a retry with the same id returns the first result and generates nothing.")


class Sample(BaseModel):
    """One trajectory. A failed sample carries finish_reason 'error' instead of failing the batch."""

    token_ids: list[int] = Field(..., description="Generated token ids, the stop token included.")
    logprobs: list[float] = Field(..., description="Raw-model log-probability of each generated token.")
    text: str = Field(..., description="Decoded generated text, special tokens skipped.")
    finish_reason: FinishReason = Field(..., description="Why generation ended.")
    reward: float = Field(0.0, description="Reward function's score of this sample.")
    weight_version: int = Field(..., description="Weight version that generated every token of this sample.")


class Group(BaseModel):
    """The n samples of one prompt and their reward statistics."""

    prompt_token_ids: list[int] = Field(..., description="The prompt as the engine saw it.")
    samples: list[Sample]
    reward_mean: float
    reward_std: float = Field(..., description="Population std of the group's rewards.")
    zero_variance: bool = Field(..., description="True when every reward in the group is equal (std < 1e-6).")


class RolloutResponse(BaseModel):
    groups: list[Group] = Field(..., description="One group per prompt, in request order.")


class WeightsVersion(BaseModel):
    version: int = Field(..., description="The weight version every replica serves.")
    replicas: dict[str, int] = Field(default_factory=dict, description="Version reported by each replica.")


class WeightsPushResponse(BaseModel):
    version: int = Field(..., description="The version now served.")
    tensors: int = Field(..., description="Tensors loaded.")
    bytes: int = Field(..., description="Size of the upload.")
    seconds: float = Field(..., description="Time from upload received to every replica serving it.")


class Health(BaseModel):
    status: Literal["ok", "paused"] = Field(..., description="'paused' while sampling is paused; nothing is generated then.")
    weight_version: int
    generated_token_id: int | None = Field(None, description="The token the engine generated to prove it works.")


class ReplicaState(BaseModel):
    replica: str = Field(..., description="Ray Serve replica id.")
    weight_version: int
    paused: bool


class ControlResponse(BaseModel):
    """POST /v1/pause, /v1/resume, /v1/abort: the state of every replica after the action."""

    action: Literal["pause", "resume", "abort"]
    replicas: list[ReplicaState]


class Readiness(BaseModel):
    """GET /readyz: ready when no replica is paused and all serve one weight version."""

    ready: bool
    replicas: list[ReplicaState]


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: what went wrong, where, and how to fix it."""

    error: str
    detail: list[dict] = Field(default_factory=list, description="Per-field errors: field, message.")


# OpenAI-compatible endpoints, so evaluation tools (lm-eval and similar) can score the current policy.


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


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions; messages go through the model's chat template."""

    model: str | None = Field(None, description="Ignored: the service serves one policy.")
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, description="Deprecated OpenAI name of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
