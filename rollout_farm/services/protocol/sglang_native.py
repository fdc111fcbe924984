"""SGLang's native HTTP surface (sglang 0.5.14, srt/managers/io_struct.py and srt/sampling/sampling_params.py), so
that code written against an SGLang server works against the farm with only the URL changed.

Field names, defaults and shapes are SGLang's. A field SGLang defines that the farm cannot honour is absent here, or
accepted only at its default, so that it is refused with a 422 naming it (extra="forbid"), never ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator

from rollout_farm.services.protocol.common import (
    INT64_MAX,
    MAX_N,
    MAX_NEW_TOKENS,
    MAX_PROMPTS,
    MAX_STOPS,
    Dim,
    Float,
    Int64,
    NonEmptyIds,
    NonEmptyText,
    RequestModel,
    Temperature,
    Text,
    TokenId,
    decimal_at_most,
)

TopLogprobs = Annotated[int, Field(ge=0, le=20)]
LogprobStart = Annotated[int, Field(ge=-1, le=INT64_MAX)]
VERSION = decimal_at_most(INT64_MAX)  # SGLang's weight_version as the farm's integer version, 1..INT64_MAX


class SGLangSamplingParams(RequestModel):
    """SGLang's sampling_params, the subset the farm's engines honour (the farm's SamplingParams underneath)."""

    max_new_tokens: int = Field(128, ge=1, le=MAX_NEW_TOKENS, description="Most tokens to generate.")
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = Field(
        None, description="Strings that end the sample (trimmed from `text`)."
    )
    stop_token_ids: list[TokenId] | None = Field(None, description="Token ids that end the sample, besides EOS.")
    temperature: Temperature = Field(
        1.0, ge=0.0, le=100.0, description="Softmax temperature; 0 means greedy, else at least 1e-6."
    )
    top_p: Float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: Int64 = Field(
        -1, ge=-1, description="Keep the k most likely tokens; -1 keeps all.", json_schema_extra={"not": {"const": 0}}
    )
    n: int = Field(1, ge=1, le=MAX_N, description="Samples per prompt (answers are prompt-major).")
    regex: Text | None = Field(
        None, max_length=2000, description="Constrain the text to match this regular expression."
    )
    ignore_eos: bool = Field(False, description="Keep generating past EOS, up to max_new_tokens.")
    sampling_seed: Int64 | None = Field(None, ge=0, description="Seed for reproducible sampling (farm: seed).")


class GenerateRequest(RequestModel):
    """POST /generate: SGLang's GenerateReqInput, single (`text` a string, `input_ids` a flat list) or batch."""

    # the service's rule, for the schema: exactly one of text and input_ids
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"properties": {"text": {"type": ["string", "array"]}}, "required": ["text"]},
                {"properties": {"input_ids": {"type": "array"}}, "required": ["input_ids"]},
            ]
        }
    )

    text: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(max_length=MAX_PROMPTS, json_schema_extra={"minItems": 1})]
        | None
    ) = Field(None, description=f"Prompt text(s); give this or input_ids. At most {MAX_PROMPTS} prompts.")
    input_ids: (
        NonEmptyIds
        | Annotated[list[NonEmptyIds], Field(max_length=MAX_PROMPTS, json_schema_extra={"minItems": 1})]
        | None
    ) = Field(None, description="Prompt token ids; or text.")
    sampling_params: list[SGLangSamplingParams] | None = Field(
        None, description="One dict for every prompt, or one per prompt (a dict is read as a list of one)."
    )
    rid: NonEmptyText | Annotated[list[Text], Field(json_schema_extra={"uniqueItems": True})] | None = Field(
        None,
        description="Request id (meta_info.id; a batch's string becomes rid_0, rid_1, ...). A string rid also keys "
        "the farm's request table: POST /abort_request cancels it, and a repeat of it returns the first answer.",
    )
    return_logprob: bool | list[bool] | None = Field(None, description="Return logprobs (one flag, or one per prompt).")
    logprob_start_len: LogprobStart | list[LogprobStart] | None = Field(
        None, description="First prompt position to return input logprobs for; -1 (default): none."
    )
    top_logprobs_num: TopLogprobs | list[TopLogprobs] | None = Field(
        None, description="With return_logprob: the k most likely tokens at each position (0..20)."
    )
    return_text_in_logprobs: bool = Field(False, description="Fill the text slot of [logprob, token_id, text].")
    stream: bool = Field(False, description="Server-sent events; the farm sends each answer as one whole chunk.")
    lora_path: NonEmptyText | list[NonEmptyText | None] | None = Field(
        None,
        description="The LoRA adapter to sample from (one, or one per prompt; null: the base): as in SGLang, a "
        "loaded adapter's name, here 'name@vN' or 'name' (its newest resident version). 404 for one the caller may "
        "not use.",
    )

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _one_as_list(cls, v):
        return [v] if isinstance(v, dict) else v


class UpdateWeightsFromDiskRequest(RequestModel):
    """POST /update_weights_from_disk: the farm's path push (POST /v1/weights/path), two phases over every replica."""

    model_path: Text = Field(..., min_length=1, description="Folder of *.safetensors files (inside FARM_WEIGHTS_DIR).")
    load_format: Literal["safetensors"] | None = Field(None, description="Only safetensors folders are read.")
    abort_all_requests: bool = Field(False, description="True: in-flight samples abort and rerun (policy 'abort').")
    weight_version: Text | None = Field(
        None,
        description="The new version, an integer; default: the served one + 1.",
        json_schema_extra={"pattern": VERSION},
    )
    is_async: Literal[False] = Field(False, description="Pushes return once every replica serves the version.")
    torch_empty_cache: bool = Field(False, description="Accepted; the farm keeps no allocator cache to empty.")
    keep_pause: Literal[False] = Field(False, description="The farm's push does not pause: nothing to keep.")
    recapture_cuda_graph: bool = Field(False, description="Accepted; the farm's engines capture no CUDA graphs.")
    token_step: Int64 = Field(0, ge=0, description="Accepted; the farm versions by weight_version.")
    flush_cache: bool = Field(True, description="Accepted; the farm's engines keep no prefix cache across requests.")
    manifest: None = Field(None, description="Tensor metadata: not supported (the files' own headers are read).")

    @field_validator("weight_version")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        return farm_version(v)


class InitWeightsUpdateGroupRequest(RequestModel):
    """POST /init_weights_update_group: every replica joins the trainer's NCCL group (/v1/weights/distributed/init)."""

    master_address: Text = Field(..., description="The trainer's rendezvous host.")
    master_port: int = Field(..., ge=1, le=65535, description="The trainer's rendezvous port.")
    rank_offset: Int64 = Field(..., ge=0, description="Rank of the first replica's first GPU.")
    world_size: Int64 = Field(..., ge=2, description="Trainer plus every replica's GPUs.")
    group_name: Text = Field("weight_update_group", description="The process group's name.")
    backend: Text = Field("nccl", description="torch.distributed backend.")


class UpdateWeightsFromDistributedRequest(RequestModel):
    """POST /update_weights_from_distributed: the trainer broadcasts the tensors (farm: /v1/weights/distributed)."""

    names: list[Text] = Field(..., min_length=1, description="Tensor names, in broadcast order.")
    dtypes: list[Text] = Field(..., min_length=1, description="Each tensor's dtype, e.g. 'bfloat16'.")
    shapes: list[list[Dim]] = Field(..., min_length=1, description="Each tensor's shape.")
    group_name: Text = Field("weight_update_group", description="The process group's name.")
    flush_cache: bool = Field(True, description="Accepted; the farm's engines keep no prefix cache across requests.")
    abort_all_requests: Literal[False] = Field(False, description="Not supported on the NCCL transport.")
    weight_version: Text | None = Field(
        None,
        description="The new version, an integer; default: the served one + 1.",
        json_schema_extra={"pattern": VERSION},
    )
    load_format: None = Field(None, description="Only one broadcast per tensor (no 'flattened_bucket').")
    torch_empty_cache: bool = Field(False, description="Accepted; the farm keeps no allocator cache to empty.")

    @field_validator("weight_version")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        return farm_version(v)


class PauseGenerationRequest(RequestModel):
    """POST /pause_generation: admit nothing until /continue_generation; what runs is aborted or held."""

    mode: Literal["abort", "retract", "in_place"] = Field(
        "abort",
        description="'abort': running requests end at their next token, answering with their tokens so far "
        "(finish_reason abort). 'in_place': they are held at a step boundary with their KV cache. 'retract': they go "
        "back to the waiting queue, their KV cache dropped, and continue later from prompt + tokens so far. Held "
        "requests go on after /continue_generation, under the weights served then. The torch engine holds; other "
        "engines answer 501 to 'in_place' and 'retract'. POST /v1/pause lets running calls finish instead.",
    )


class ContinueGenerationRequest(RequestModel):
    """POST /continue_generation: admit generation again on every replica."""

    torch_empty_cache: bool = Field(True, description="Accepted; the farm keeps no allocator cache to empty.")


class AbortRequest(RequestModel):
    """POST /abort_request: cancel a /generate by its string rid, or everything running."""

    # the service's rule, for the schema: a rid, or abort_all
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"properties": {"rid": {"minLength": 1}}, "required": ["rid"]},
                {"properties": {"abort_all": {"const": True}}, "required": ["abort_all"]},
            ]
        }
    )

    rid: Text = Field(
        "", description="The string rid a /generate was sent with: it answers at once with the tokens it generated."
    )
    abort_all: bool = Field(False, description="End every replica's running generation at its next token.")


def farm_version(v: str | None) -> str | None:
    """SGLang's string weight_version must be one of the farm's integer versions, 1..INT64_MAX."""
    if v is not None and not (re.fullmatch(VERSION, v) and int(v) <= INT64_MAX):
        raise ValueError(f"{v!r}: the farm's versions are integers from 1 to {INT64_MAX}, in ASCII digits")
    return v
