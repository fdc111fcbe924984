"""Anthropic's Messages API on a session (`POST /v1/sessions/{id}/anthropic/v1/messages` and its `count_tokens`), as
the official `anthropic` SDK (2.17.0) sends it: its names, its content blocks.

The farm serves what it can honour: text, tool_use, tool_result and thinking blocks, client tools, tool_choice, stop
sequences and the sampling knobs. Any other field or block (images, documents, server tools, citations, a thinking
budget, service tiers) is a 422 naming it, never ignored. `cache_control` is accepted and has no effect: Anthropic's
prompt caching changes no output (its docs: the response is identical with or without caching), and a session keeps
its KV cache on its home replica anyway. `metadata` (a user id) changes no output either.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, Field

from rollout_farm.services.protocol.common import (
    MAX_NEW_TOKENS,
    MAX_STOPS,
    Float,
    Int64,
    NonEmptyText,
    RequestModel,
    Text,
    optional_temperature,
    text_or_list,
    wire_safe_tree,
)

JSONObject = Annotated[dict[str, Any], AfterValidator(wire_safe_tree)]


class CacheControl(RequestModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


CACHE = Field(None, description="Accepted, no effect: prompt caching changes no output; a session keeps its KV cache.")


class TextBlock(RequestModel):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = CACHE


class ThinkingBlock(RequestModel):
    """The reasoning of an earlier answer, sent back: the session's tokens keep the reasoning the model sampled, so
    this must repeat it (or be left out); other text rewrites the turn (a fork)."""

    type: Literal["thinking"]
    thinking: Text
    signature: Text = Field(..., description="As the farm gave it (it signs nothing: any text).")


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: JSONObject = Field(..., description="The call's arguments.")
    cache_control: CacheControl | None = CACHE


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: Text = Field(..., description="The id of a tool_use block earlier in `messages`.")
    content: text_or_list(TextBlock) = Field("", description="The result: text, or text blocks (joined).")
    is_error: bool = Field(False, description="The tool failed: the result is rendered as 'Error: <content>'.")
    cache_control: CacheControl | None = CACHE


Block = Annotated[Union[TextBlock, ThinkingBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(RequestModel):
    role: Literal["user", "assistant", "system"]
    content: text_or_list(Block) = Field(
        ...,
        description="Text, or blocks: text and tool_result from the user; text, thinking and tool_use from the "
        "assistant; text in a system message.",
    )


class Tool(RequestModel):
    """A client tool, served as an OpenAI function tool (name, description, parameters = input_schema)."""

    type: Literal["custom"] | None = None
    name: NonEmptyText
    description: Text | None = None
    input_schema: JSONObject = Field(..., description="JSON Schema of the tool's input.")
    cache_control: CacheControl | None = CACHE


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: Literal[False] = Field(
        False, description="true is refused: no parser can stop a model writing a second call."
    )


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: Literal[False] = False


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: Text
    disable_parallel_tool_use: Literal[False] = False


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[
    Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone], Field(discriminator="type")
]


class ThinkingAdaptive(RequestModel):
    type: Literal["adaptive"]


class Metadata(RequestModel):
    user_id: Text | None = Field(None, description="Accepted, no effect on the output.")


class CountTokensRequest(RequestModel):
    """POST /v1/sessions/{id}/anthropic/v1/messages/count_tokens."""

    model: Text = Field(..., description="Any name: the service serves one policy.")
    messages: list[Message] = Field(..., min_length=1)
    system: text_or_list(TextBlock) | None = Field(None, description="The system prompt: text, or text blocks.")
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingAdaptive | None = Field(
        None,
        description="adaptive only (the model decides, as its chat template has it); a budget or a switch is "
        "refused: the farm cannot make the model think or not.",
    )
    cache_control: CacheControl | None = CACHE


class MessagesRequest(CountTokensRequest):
    """POST /v1/sessions/{id}/anthropic/v1/messages: one turn of the session."""

    max_tokens: int = Field(..., ge=1, le=MAX_NEW_TOKENS, description="Most tokens the turn samples.")
    stop_sequences: Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = Field(
        None, description="A sample ends when its text contains one (kept in the text: the tokens are kept exactly)."
    )
    temperature: optional_temperature(1.0) | None = Field(None, description="Default: the session's.")
    top_p: Float | None = Field(None, gt=0.0, le=1.0, description="Default: the session's.")
    top_k: Int64 | None = Field(None, ge=1, description="Default: the session's.")
    stream: bool = Field(
        False,
        description="Server-sent events in Anthropic's types: the turn is sampled whole, then sent as message_start, "
        "one block at a time (start, one delta, stop), message_delta and message_stop.",
    )
    metadata: Metadata | None = None
