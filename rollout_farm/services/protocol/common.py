"""What every part of the API shares: limits, sampling params, prompts and the error body."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

API_VERSION = "v1"
MAX_N = 64  # most samples per prompt in one request
MAX_PROMPTS = 512  # most prompts in one request
MAX_NEW_TOKENS = 4096  # most tokens one sample may generate
MAX_STOPS = 16  # most stop strings per request
INT64_MAX = 2**63 - 1  # every integer of a request fits a signed 64-bit integer (torch.long, C long)
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: the engines compute in float32
MIN_TEMPERATURE = 1e-6  # the smallest temperature above 0 (SGLang's greedy threshold); 1e-38 overflowed the logits
NO_NUL = "^[^\\u0000]*$"  # the JSON Schema pattern of a string without a NUL character
UNSAFE_CHARS = re.compile("[\x00\ud800-\udfff]")  # NUL, and lone surrogates (JSON can escape one)


def decimal_at_most(n: int) -> str:
    """The JSON Schema pattern of exactly the decimal integers 1..n (ASCII digits, no sign, no leading zero), for an
    integer sent as a string: a pattern cannot compare numbers, so each digit's bound is spelt out."""
    digits = str(n)
    alternatives = [f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else []  # fewer digits than n
    for i, d in enumerate(digits):  # as many digits: n's first i, then a smaller digit, then any
        low, rest = (1 if i == 0 else 0), len(digits) - i - 1
        if int(d) - 1 >= low:
            alternatives.append(f"{digits[:i]}[{low}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    return "^(" + "|".join([*alternatives, digits]) + ")$"


FinishReason = Literal["stop", "length", "abort", "error"]
InFlightPolicy = Literal["finish", "abort", "partial"]


# What every request field is checked for beyond its own range, each a 422 naming the field (docs/api.md, "Input
# limits"): NaN, infinities and subnormal floats, NUL characters in strings, integers beyond int64. RequestModel checks
# the floats and strings of every request; the annotated types below say the same in the OpenAPI schema.
BEYOND_SCHEMA = "beyond_schema"  # the error type of a validator's rule that JSON Schema cannot say


def beyond_schema(message: str) -> PydanticCustomError:
    """Raise this, not ValueError, from a validator whose rule JSON Schema cannot say (a lone surrogate, a regular
    expression that compiles, an item's relation to its position): its 422 is the service's own refusal, not a
    mismatch with the published schema (rollout_farm/services/errors.py, SCHEMA_MISMATCH;
    tests/service/test_fuzz.py)."""
    return PydanticCustomError(BEYOND_SCHEMA, message)


def _wire_problem(x) -> str | None:
    if isinstance(x, str) and (bad := UNSAFE_CHARS.search(x)):
        what = "a NUL character" if bad.group() == "\x00" else "a lone surrogate, which is not Unicode text"
        return f"contains {what} ({ascii(bad.group())}) at index {bad.start()}: remove it"
    if isinstance(x, float) and not math.isfinite(x):
        return f"{x} is not a finite number: give a finite one (JSON has no NaN or Infinity)"
    if isinstance(x, float) and 0 < abs(x) < FLOAT32_TINY:
        return (
            f"{x!r} is a subnormal number, which float32 (the engines' precision) flushes to zero: give 0, or a "
            f"value of at least {FLOAT32_TINY:.4g} in magnitude"
        )
    return None


class RequestModel(BaseModel):
    """A request body. No string of it (a field, or an item of a list field) may hold a NUL character or a lone
    surrogate: they would reach file paths, tokenizers and C code. No float may be NaN, infinite or subnormal in
    float32. Each is a 422 naming the field. A field the model does not define is refused the same way (a 422
    naming it), never ignored: a misspelt `sampling_params` would otherwise sample with the defaults."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _wire_safe(cls, v):
        for x in v if isinstance(v, list) else [v]:
            if problem := _wire_problem(x):
                if isinstance(x, str) and "\x00" not in x:  # a lone surrogate: no pattern excludes it alone
                    raise beyond_schema(problem)
                raise ValueError(problem)
        return v


def wire_safe_tree(value):
    """A free-form JSON value (a tool's schema or input) whose strings and floats pass the same checks as a request's
    fields, at any depth: a 422 naming the field, since the answer may echo it (no JSON has NaN, no UTF-8 a lone
    surrogate)."""
    for x in value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]:
        if isinstance(x, (dict, list)):
            wire_safe_tree(x)
        elif problem := _wire_problem(x):
            raise beyond_schema(problem)
    for key in value if isinstance(value, dict) else []:
        if problem := _wire_problem(key):
            raise beyond_schema(problem)
    return value


def _temperature(v: float) -> float:
    if 0 < v < MIN_TEMPERATURE:
        raise ValueError(
            f"{v!r} is above 0 but below {MIN_TEMPERATURE}: it samples greedily anyway, and the smallest such "
            f"temperatures overflow the float32 logits; give 0 for greedy, or at least {MIN_TEMPERATURE}"
        )
    return v


SUBNORMAL = {"exclusiveMinimum": -FLOAT32_TINY, "exclusiveMaximum": FLOAT32_TINY, "not": {"const": 0}}
Float = Annotated[float, Field(allow_inf_nan=False, json_schema_extra={"not": SUBNORMAL})]
"""A finite float that float32 holds as a normal number, or 0 (RequestModel checks; the schema says so)."""
Temperature = Annotated[
    Float,
    AfterValidator(_temperature),
    Field(json_schema_extra={"not": {"exclusiveMinimum": 0, "exclusiveMaximum": MIN_TEMPERATURE}}),
]
"""0 (greedy) or at least MIN_TEMPERATURE; give the range on the field (ge=0, le=...), which must not be optional."""


def optional_temperature(top: float):
    """Temperature from 0 to `top`, the range inside the type, for an optional field: given on an optional field,
    pydantic writes the range into the schema as "ge" and "le", which JSON Schema ignores."""
    return Annotated[
        Float,
        Field(ge=0.0, le=top),
        AfterValidator(_temperature),
        Field(json_schema_extra={"not": {"exclusiveMinimum": 0, "exclusiveMaximum": MIN_TEMPERATURE}}),
    ]


Int64 = Annotated[int, Field(le=INT64_MAX)]
"""An integer up to int64's maximum. Give the lower bound on the field (ge=...), never an le: pydantic lets the
annotation's own bounds override the field's."""
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""A token id; the model's vocabulary bounds it further (a 422 naming the prompt, checked by the service)."""
Dim = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""A tensor dimension."""
Text = Annotated[str, Field(json_schema_extra={"pattern": NO_NUL})]
"""A string without NUL characters (RequestModel checks; the schema says so)."""


def text_or_list(item) -> Any:
    """Text, or a list of `item`: the JSON value's type picks the branch, so a refusal inside the list (a
    beyond_schema one, say) is reported alone, not beside "Input should be a valid string" from the other branch
    (which would read as the schema's refusal: rollout_farm/services/errors.py, SCHEMA_MISMATCH)."""
    return Annotated[
        Union[Annotated[Text, Tag("text")], Annotated[list[item], Tag("list")]],
        Discriminator(lambda v: "text" if isinstance(v, str) else "list"),
    ]


NonEmptyText = Annotated[str, Field(json_schema_extra={"pattern": NO_NUL, "minLength": 1})]
# for the schema: the service refuses an empty list of token ids too (with its message, naming the field)
NonEmptyIds = Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})]
"""Text that must not be empty: the schema says so, and the model's validator or the endpoint refuses "" with its own
message naming the field (a stop string, a prompt)."""


class SamplingParams(RequestModel):
    """How each sample is drawn. Logprobs are always those of the raw model (see README)."""

    temperature: Temperature = Field(
        1.0, ge=0.0, le=100.0, description=f"Softmax temperature; 0 means greedy, else at least {MIN_TEMPERATURE}."
    )
    top_p: Float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: Int64 = Field(
        -1,
        ge=-1,
        description="Keep the k most likely tokens; -1 keeps all (0 is refused).",
        json_schema_extra={"not": {"const": 0}},
    )
    max_new_tokens: int = Field(128, ge=1, le=MAX_NEW_TOKENS, description="Most tokens to generate per sample.")
    stop_token_ids: list[TokenId] = Field(
        default_factory=list, description="Extra token ids that end a sample (EOS always does)."
    )
    stop: list[NonEmptyText] = Field(
        default_factory=list,
        max_length=MAX_STOPS,
        description="Strings that end a sample when its text contains one (SGLang's `stop`); the sample keeps the "
        "tokens up to the one that completed it.",
    )
    ignore_eos: bool = Field(
        False, description="Keep generating past EOS, up to max_new_tokens (stop_token_ids still stop)."
    )
    seed: Int64 | None = Field(None, ge=0, description="Seed for reproducible sampling of an identical request.")
    regex: Text | None = Field(
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
                raise beyond_schema(f"not a valid regular expression: {e}") from None
        return v


class Prompt(RequestModel):
    """One prompt: either text or token ids, plus what the reward function compares with."""

    # the model validator's rule, for the schema: exactly one of a non-empty text and non-empty token ids
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"properties": {"text": {"type": "string"}}, "required": ["text"]},
                {"properties": {"token_ids": {"type": "array"}}, "required": ["token_ids"]},
            ]
        }
    )

    text: Text | None = Field(
        None,
        description="Prompt text; tokenized by the service without special tokens.",
        json_schema_extra={"minLength": 1},
    )
    token_ids: list[TokenId] | None = Field(
        None, description="Prompt token ids; used instead of text.", json_schema_extra={"minItems": 1}
    )
    ground_truth: Text | None = Field(None, description="Reference answer handed to the reward function.")

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
