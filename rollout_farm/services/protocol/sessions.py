"""Sessions: multi-turn rollouts whose tokens the farm keeps exactly (tokens in, tokens out).

A client opens a session, then sends each turn's new token ids; the farm appends them to the session's tokens,
samples, and appends the sampled ids verbatim. The trajectory gives every segment's tokens with the loss mask,
logprobs and per-token weight versions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from rollout_farm.services.protocol.adapters import AdapterRef, Policy
from rollout_farm.services.protocol.common import (
    MAX_NEW_TOKENS,
    MAX_STOPS,
    Float,
    Int64,
    NonEmptyText,
    RequestModel,
    SamplingParams,
    Text,
    TokenId,
    beyond_schema,
    optional_temperature,
)
from rollout_farm.services.protocol.openai import StreamOptions, TextPart
from rollout_farm.services.protocol.rollouts import SampledWith, SamplerSpec

MAX_SESSION_TTL_S = 7 * 86400


TURN_POLICIES = (
    "The policies that drew the turn ({base_version, adapter, adapter_version, digest}: docs/tenants.md), in token "
    "order: one, unless a base commit landed mid-turn (then one per base version of its tokens, as a sample's "
    "`policies`). An adapter given as min_version may resolve to another version each turn. Null: a turn stored "
    "before turns kept their policy, or an engine that runs no model."
)


class SessionCreate(RequestModel):
    """POST /v1/sessions."""

    sampling_params: SamplingParams = Field(
        default_factory=SamplingParams, description="Every turn's sampling params, unless the turn gives its own."
    )
    sampler: SamplerSpec = Field(
        default_factory=SamplerSpec, description="How each turn is drawn (one sample per turn: n=1 samplers)."
    )
    group_id: Text | None = Field(None, description="The GRPO group this episode belongs to (returned as given).")
    min_weight_version: Int64 = Field(0, ge=0, description="Every turn runs on this weight version or later.")
    adapter: AdapterRef | None = Field(
        None,
        description="Every turn samples from this LoRA adapter (an exact version, or the newest resident from "
        "min_version, resolved at each turn); null: the base model. Every turn's rollout is checked against the "
        "version's digest; each turn records the policy that drew it (`policies`).",
    )
    tool_format: Text = Field(
        "auto",
        description="How the model writes tool calls: auto (told from the model's chat template), or a format of "
        "TOOL_FORMATS: hermes, qwen3-xml, llama3-json, mistral, mistral-v11, deepseek-v3, deepseek-v3.1, harmony, "
        "plain. The session's info shows the one chosen.",
    )
    malformed_tool_calls: Literal["train", "mask"] = Field(
        "train",
        description="A turn whose tool call did not parse: train on it (its tokens keep loss mask 1) or mask it (0).",
    )
    ttl_s: Float = Field(
        3600.0, gt=0, le=MAX_SESSION_TTL_S, description="The session is forgotten this long after its last turn."
    )


class SessionInfo(BaseModel):
    session_id: str
    base_url: str = Field(..., description="The session's own base URL (its routes are under it).")
    group_id: str | None = None
    tool_format: str
    turns: int = Field(..., description="Sampled turns in the head segment.")
    tokens: int = Field(..., description="Tokens in the head segment.")
    segments: int
    closed: bool


class SessionGenerate(RequestModel):
    """POST /v1/sessions/{id}/generate: token ids in, token ids out."""

    append_token_ids: list[TokenId] = Field(
        ..., description="Token ids to append before sampling (the prompt, a tool result, the template's tokens)."
    )
    turn: int | None = Field(
        None,
        ge=0,
        description="Which turn this is (0 first). A repeat of an answered turn with the same ids gets that answer "
        "again (a retry); None: the next turn.",
    )
    offset: int | None = Field(
        None,
        ge=0,
        description="Keep only the first `offset` tokens of the session and append after them: a rewrite, which "
        "starts a new segment naming its parent. None: keep every token.",
    )
    sampling_params: SamplingParams | None = Field(None, description="This turn's params; default: the session's.")


class SessionTurn(BaseModel):
    session_id: str
    segment_id: str
    turn: int = Field(..., description="The turn's index in its segment.")
    prompt_tokens: int = Field(
        ..., description="The segment's tokens before the sampled ones: the prompt sampled from."
    )
    token_ids: list[int] = Field(..., description="The sampled ids, appended to the segment as they are.")
    logprobs: list[float]
    sampling_logprobs: list[float] | None = Field(
        None, description="Under the distribution sampled; None where the engine reported none (as for a rollout)."
    )
    sampled_with: SampledWith | None = Field(None, description="The params the turn was drawn with.")
    finish_reason: str
    weight_version: int
    token_weight_versions: list[int]
    policies: list[Policy] | None = Field(None, description=TURN_POLICIES)


class SessionReward(RequestModel):
    """POST /v1/sessions/{id}/reward."""

    reward: Float
    turn: int | None = Field(None, ge=0, description="The turn it scores; None: the whole episode (final).")


class TurnSpan(BaseModel):
    start: int
    end: int
    finish_reason: str
    reward: float | None = None
    sampled_with: SampledWith | None = Field(
        None,
        description="The params the turn was drawn with, after the sampler's plan (a sampler may change them between "
        "turns); None for a turn stored before they were kept.",
    )
    policies: list[Policy] | None = Field(None, description=TURN_POLICIES)
    sampling_known: bool = Field(
        True,
        description="Whether the segment's sampling_logprobs on this turn are q, the distribution it was drawn from: "
        "false when the engine reported none (SGLang, greedy) and the raw logprobs differ from q (a temperature, "
        "top-p, top-k or regex); they are 0.0 then.",
    )


class SegmentOut(BaseModel):
    segment_id: str
    parent: str | None = Field(None, description="The segment this one forked from.")
    parent_tokens: int = Field(0, description="Its first parent_tokens tokens are the parent's (loss mask 0 here).")
    token_ids: list[int]
    loss_mask: list[int] = Field(..., description="1 exactly on the tokens sampled in this segment.")
    logprobs: list[float] = Field(..., description="Raw-model logprob of each sampled token; 0.0 elsewhere.")
    sampling_logprobs: list[float] = Field(
        ...,
        description="Under the distribution sampled (the raw logprobs where those are it); 0.0 elsewhere and on a "
        "turn whose sampling_known is false.",
    )
    token_versions: list[int] = Field(..., description="Weight version of each sampled token; -1 elsewhere.")
    turns: list[TurnSpan]


class Trajectory(BaseModel):
    session_id: str
    group_id: str | None = None
    closed: bool
    reward: float | None = Field(None, description="The final reward, if one was given.")
    segments: list[SegmentOut] = Field(..., description="In creation order; the last is the head.")


class SessionList(BaseModel):
    sessions: list[str]


class FunctionCall(RequestModel):
    name: Text
    arguments: Text = Field(..., description="The JSON text of an object, as OpenAI sends it.")


class ToolCallIn(RequestModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = Field(
        None,
        ge=0,
        description="The call's number in a streamed answer, as clients that accumulate chunks send it back: it must "
        "be the call's position in tool_calls (it is not part of the history).",
    )


class SessionMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = Field(None, description="None only on an assistant turn that calls tools.")
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="An assistant turn's calls, as the farm gave them.")
    tool_call_id: Text | None = Field(None, description="The call a tool message answers.")
    reasoning_content: Text | None = Field(
        None,
        description="An assistant turn's reasoning, as clients of reasoning models send it apart from the content. "
        "The session's tokens keep the reasoning the model sampled: left out, or repeated here or as the content's "
        "<think> block, the turn is the same one; changed, it rewrites the history (a fork).",
    )

    @model_validator(mode="after")
    def calls_numbered_in_order(self) -> SessionMessage:
        if self.reasoning_content is not None and self.role != "assistant":
            raise beyond_schema(f"reasoning_content on a {self.role} message: only an assistant turn has reasoning")
        for i, call in enumerate(self.tool_calls or []):
            if call.index not in (None, i):
                raise beyond_schema(f"tool_calls.{i}.index is {call.index}: a call's index is its position ({i})")
        return self

    def as_chat(self) -> dict:
        """The message as a chat template takes it (developer as system, text parts joined; the parts kept apart as
        `content_parts`, for rollout_farm/services/episodes/history_match.py)."""
        text = (
            self.content
            if isinstance(self.content, str) or self.content is None
            else "".join(p.text for p in self.content)
        )
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text or ""}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude={"index"}) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if isinstance(self.content, list):  # the parts as sent: a harness may merge tool results as parts
            out["content_parts"] = [p.text for p in self.content]
        return out


class NamedFunction(RequestModel):
    name: Text


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class SessionChatRequest(RequestModel):
    """POST /v1/sessions/{id}/chat/completions: OpenAI chat with tools, on the session's tokens. One choice; other
    OpenAI fields are refused with a 422 naming them."""

    model: Text | None = Field(None, description="Any name: the service serves one policy.")
    messages: list[SessionMessage] = Field(..., min_length=1, description="The whole history, as OpenAI takes it.")
    tools: list[dict] | None = Field(None, description="OpenAI function tools; parameters must be JSON Schema.")
    tool_choice: Literal["auto", "none"] | NamedToolChoice = Field(
        "auto",
        description="auto: the model may call; none: calls are not read; a named function: the call's opening is "
        "appended as context and the model writes its arguments.",
    )
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, description="Old name of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: optional_temperature(2.0) | None = Field(None, description="Default: the session's.")
    top_p: Float | None = Field(None, gt=0.0, le=1.0, description="Default: the session's.")
    top_k: Int64 | None = Field(
        None, ge=-1, description="vLLM's extension: keep the k most likely tokens (-1: all). Default: the session's."
    )
    n: Literal[1] = Field(1, description="A session samples one turn at a time.")
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = None
    seed: Int64 | None = Field(None, ge=0)
    logprobs: bool = Field(False, description="Return each sampled token's logprob.")
    stream: bool = Field(
        False,
        description="Server-sent events in OpenAI's chunk format: the turn is sampled whole, so one chunk carries its "
        "content and tool_calls (each with its index), the next its finish_reason, then [DONE].",
    )
    stream_options: StreamOptions | None = Field(None, description="include_usage: a last chunk with the usage.")
    parallel_tool_calls: Literal[True] | None = Field(
        None,
        description="true or unset: every call a turn makes is read (false is refused: no parser can stop a model "
        "writing a second call).",
    )
    user: Text | None = None
    return_token_ids: bool | None = Field(
        None,
        description="vLLM's extension: the answer carries `prompt_token_ids` (the segment's tokens before the turn) "
        "and `choices[0].token_ids` (the sampled ids); streamed, the first chunk carries both.",
    )
