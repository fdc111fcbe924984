"""What every part of the API shares: limits, sampling params, prompts and the error body."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

API_VERSION = "v1"
MAX_N = 64  # most samples per prompt in one request
MAX_PROMPTS = 512  # most prompts in one request
MAX_NEW_TOKENS = 4096  # most tokens one sample may generate

FinishReason = Literal["stop", "length", "abort", "error"]
InFlightPolicy = Literal["finish", "abort", "partial"]


class SamplingParams(BaseModel):
    """How each sample is drawn. Logprobs are always those of the raw model (see README)."""

    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Softmax temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens; -1 keeps all.")
    max_new_tokens: int = Field(128, ge=1, le=MAX_NEW_TOKENS, description="Most tokens to generate per sample.")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Extra token ids that end a sample (EOS always does)."
    )
    stop: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Strings that end a sample when its text contains one (SGLang's `stop`); the sample keeps the "
        "tokens up to the one that completed it.",
    )
    ignore_eos: bool = Field(
        False, description="Keep generating past EOS, up to max_new_tokens (stop_token_ids still stop)."
    )
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="Seed for reproducible sampling of an identical request."
    )
    regex: str | None = Field(
        None,
        max_length=2000,
        description="Constrain each sample's text to match this regular expression in full (SGLang's `regex`; the "
        "torch engine masks the tokens that would leave it). EOS is allowed only on a full match.",
    )

    @model_validator(mode="after")
    def _top_k_not_zero(self) -> "SamplingParams":
        if self.top_k == 0:
            raise ValueError("top_k=0 keeps no token: use -1 to keep all, or a positive k")
        return self

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("a stop string is empty: remove it")
        return v

    @field_validator("regex")
    @classmethod
    def _regex_compiles(cls, v: str | None) -> str | None:
        if v is not None:
            import regex

            try:
                regex.compile(v)
            except regex.error as e:
                raise ValueError(f"not a valid regular expression: {e}") from None
        return v


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


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: what went wrong, where, and how to fix it."""

    error: str
    detail: list[dict] = Field(default_factory=list, description="Per-field errors: field, message.")
