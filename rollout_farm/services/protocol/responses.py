"""OpenAI's Responses API on a session (`POST /v1/sessions/{id}/v1/responses`, and `/v1/sessions/{id}/responses`),
as the `openai` SDK (3.57) sends it: its names, its input items.

The farm serves what it can honour: messages (input_text / output_text parts), function calls and their outputs,
reasoning items (their text), instructions, function tools, tool_choice, max_output_tokens, temperature, top_p,
previous_response_id within the session. Any other field or item (images, files, built-in tools, item references,
reasoning effort, strict tools) is a 422 naming it, never ignored. `store` is accepted either way: it changes no
output, and a session keeps every turn (its trajectory), so a later previous_response_id finds it regardless.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, Discriminator, Field, Tag

from rollout_farm.services.protocol.common import (
    MAX_NEW_TOKENS,
    Float,
    NonEmptyText,
    RequestModel,
    Text,
    optional_temperature,
    text_or_list,
    wire_safe_tree,
)

STATUS = Literal["in_progress", "completed", "incomplete"]


class InputText(RequestModel):
    type: Literal["input_text"]
    text: Text


class OutputText(RequestModel):
    """An earlier answer's text, sent back as the SDK gives it (annotations and logprobs are ignored: they are the
    farm's own, empty)."""

    type: Literal["output_text"]
    text: Text
    annotations: list[dict] = Field(default_factory=list, max_length=0, description="The farm gives none.")
    logprobs: list[dict] | None = None


Part = Annotated[Union[InputText, OutputText], Field(discriminator="type")]


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: text_or_list(Part)
    id: Text | None = Field(None, description="An earlier output item's id (ignored: the content says the turn).")
    status: STATUS | None = None


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text = Field(..., description="The JSON text of the call's arguments.")
    id: Text | None = None
    status: STATUS | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: Text = Field(..., description="The call_id of a function_call earlier in the history.")
    output: text_or_list(InputText) = Field(..., description="The result: text, or input_text parts (joined).")
    id: Text | None = None
    status: STATUS | None = None


class ReasoningText(RequestModel):
    type: Literal["reasoning_text"]
    text: Text


class SummaryText(RequestModel):
    type: Literal["summary_text"]
    text: Text


class ReasoningItem(RequestModel):
    """An earlier answer's reasoning, sent back: the assistant turn that follows carries it as its reasoning."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[SummaryText] = Field(default_factory=list, description="Ignored: the farm gives no summary.")
    content: list[ReasoningText] | None = None
    status: STATUS | None = None


def item_type(v: Any) -> str | None:
    return v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)


Item = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
    ],
    Discriminator(item_type),
]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: NonEmptyText
    description: Text | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(wire_safe_tree)] | None = Field(
        None, description="JSON Schema of the arguments."
    )
    strict: Literal[False] | None = Field(
        None, description="true is refused: the farm does not constrain a call's arguments to the schema."
    )


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: Text


class TextFormat(RequestModel):
    type: Literal["text"]


class TextConfig(RequestModel):
    format: TextFormat | None = Field(None, description="Plain text only (no JSON schema output).")


class ResponsesRequest(RequestModel):
    """POST /v1/sessions/{id}/v1/responses: one turn of the session."""

    model: Text | None = Field(None, description="Any name: the service serves one policy.")
    input: text_or_list(Item) = Field(
        ..., description="A user message's text, or input items (the new ones only with previous_response_id)."
    )
    instructions: Text | None = Field(None, description="The system message, first in the history.")
    previous_response_id: Text | None = Field(
        None,
        description="A response of this session: the history is that turn's messages and its answer, then `input`.",
    )
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice = Field(
        "auto", description="required only with one tool (it is then that tool: a forced call names its tool)."
    )
    parallel_tool_calls: Literal[True] | None = Field(
        None, description="true or unset (false is refused: no parser can stop a model writing a second call)."
    )
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, description="Default: the session's.")
    temperature: optional_temperature(2.0) | None = Field(None, description="Default: the session's.")
    top_p: Float | None = Field(None, gt=0.0, le=1.0, description="Default: the session's.")
    store: bool | None = Field(None, description="Accepted either way: a session keeps every turn.")
    stream: bool = Field(
        False,
        description="Server-sent events: the turn is sampled whole, then told as response.created, in_progress, "
        "each output item (added, its text or arguments as one delta, done), and response.completed.",
    )
    text: TextConfig | None = None
    user: Text | None = None
