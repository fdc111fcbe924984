"""Anthropic's Messages API as a session's chat turn: the request read into the session's chat messages and OpenAI
function tools, the turn taken by Sessions.chat (the same tokens, loss mask, forks and retries as the chat route:
nothing is stored twice), and its chat completion written back as an Anthropic Message.

History, as a chat template takes it:
  system (text or text blocks)      a system message (and so is a message with role system)
  user text blocks                  a user message (its blocks joined)
  user tool_result blocks           a tool message each, answering tool_use_id (is_error: 'Error: ' + the content)
  assistant text / tool_use         the assistant's content and tool_calls (input as JSON arguments)
  assistant thinking                the assistant's reasoning_content (the stored turn keeps what the model sampled)

The answer: a thinking block for the turn's reasoning (its reasoning_content, else a leading <think> block), a text
block, a tool_use block per call; stop_reason tool_use, max_tokens, stop_sequence (the stop string the text holds) or
end_turn; the farm's token view under `farm`.
"""

from __future__ import annotations

import json

from rollout_farm.services.chat.template import for_template, prompt_ids, render
from rollout_farm.services.episodes.chat_turns import (
    door_tools,
    function_tool,
    invalid,
    renamed,
    the_one_tool,
    thinking_and_text,
)
from rollout_farm.services.errors import Invalid
from rollout_farm.services.protocol import anthropic as A
from rollout_farm.services.protocol import common as C
from rollout_farm.services.protocol import sessions as S

ROLE_BLOCKS = {"system": ("text",), "user": ("text", "tool_result"), "assistant": ("text", "thinking", "tool_use")}
CHAT_FIELDS = {"tool_choice.function.name": "tool_choice.name", "max_completion_tokens": "max_tokens"}


def chat_request(req: A.MessagesRequest) -> S.SessionChatRequest:
    """The session chat turn this Messages request asks for (422s name the Anthropic fields)."""
    return S.SessionChatRequest(
        model=req.model,
        messages=[S.SessionMessage(**m) for m in chat_messages(req)],
        tools=door_tools(function_tools(req.tools), "input_schema"),
        tool_choice=tool_choice(req),
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_sequences or None,
    )


def renamed_error(e: Invalid) -> Invalid:
    """A chat turn's 422 with the Messages API's names for its fields."""
    return renamed(e, CHAT_FIELDS)


def text_of(content: str | list[A.TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def chat_messages(req: A.CountTokensRequest) -> list[dict]:
    """The history as chat messages; a block a role cannot hold, or a tool_result answering no earlier tool_use, is a
    422 naming it."""
    out = [{"role": "system", "content": text_of(req.system)}] if req.system is not None else []
    calls: set[str] = set()  # the tool_use ids seen so far
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        for j, block in enumerate(m.content):
            if block.type not in ROLE_BLOCKS[m.role]:
                raise invalid(
                    f"messages.{i}.content.{j}.type",
                    f"a {m.role} message holds {', '.join(ROLE_BLOCKS[m.role])} blocks, not {block.type}",
                )
        out += assistant(m.content, calls) if m.role == "assistant" else user(m.role, m.content, calls, i)
    return out


def assistant(blocks: list, calls: set[str]) -> list[dict]:
    message = {
        "role": "assistant",
        "content": "".join(b.text for b in blocks if b.type == "text"),
    }
    if thinking := "".join(b.thinking for b in blocks if b.type == "thinking"):
        message["reasoning_content"] = thinking
    uses = [b for b in blocks if b.type == "tool_use"]
    if uses:
        message["tool_calls"] = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in uses
        ]
        calls.update(b.id for b in uses)
    return [message]


def user(role: str, blocks: list, calls: set[str], i: int) -> list[dict]:
    """Text blocks as one message (a run of them before a tool_result, and after), tool_result blocks as tool
    messages, in the order sent."""
    out, text = [], []
    for j, block in enumerate(blocks):
        if block.type == "text":
            text.append(block.text)
            continue
        if block.tool_use_id not in calls:
            raise invalid(
                f"messages.{i}.content.{j}.tool_use_id",
                f"{block.tool_use_id!r} is the id of no tool_use block in an earlier assistant message",
            )
        if text:
            out.append({"role": role, "content": "".join(text)})
            text = []
        result = text_of(block.content)
        result = f"Error: {result}" if block.is_error else result
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
    if text or not out:
        out.append({"role": role, "content": "".join(text)})
    return out


def function_tools(tools: list[A.Tool] | None) -> list[dict] | None:
    if tools is None:
        return None
    return [function_tool(t.name, t.description, t.input_schema) for t in tools]


def tool_choice(req: A.CountTokensRequest):
    """auto and none as they are; a named tool forced (its call's opening appended as context); any, which no
    parser can force without a name, only where one tool is given (then it is that tool)."""
    choice, names = req.tool_choice, [t.name for t in req.tools or []]
    if choice is None or choice.type == "auto":
        return "auto"
    if choice.type == "none":
        return "none"
    name = choice.name if choice.type == "tool" else None
    if choice.type == "any":
        name = the_one_tool(names, "tool_choice.type", "any", "{type: tool, name}")
    if name not in names:
        raise invalid("tool_choice.name", f"{name!r} is not one of the request's tools")
    return {"type": "function", "function": {"name": name}}


async def count_tokens(tokenizer, req: A.CountTokensRequest) -> dict:
    """The history and tools rendered whole through the model's chat template, ready for the answer: the tokens a
    session opened with this history holds before it samples (a session that sampled part of it holds the sampled
    ids instead, which may tokenize otherwise)."""
    messages = chat_messages(req)
    text = render(tokenizer, for_template(messages), function_tools(req.tools))
    if text is None:
        raise invalid("messages", "the served model has no chat template")
    return {"input_tokens": len(prompt_ids(tokenizer, C.Prompt(text=text)))}


def blocks(message: dict) -> list[dict]:
    """The answer's content blocks: thinking (its reasoning: chat_turns.thinking_and_text), text, tool_use per call."""
    thinking, content = thinking_and_text(message)
    out = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
    if content:
        out.append({"type": "text", "text": content})
    for call in message.get("tool_calls") or []:
        f = call["function"]
        out.append({"type": "tool_use", "id": call["id"], "name": f["name"], "input": json.loads(f["arguments"])})
    return out


def stopped_by(text: str, stops: list[str] | None) -> str | None:
    """The stop sequence that ended the text: of those it holds, the one that completes first."""
    found = [(text.find(s) + len(s), s) for s in stops or [] if s in text]
    return min(found)[1] if found else None


def message(out: dict, req: A.MessagesRequest) -> dict:
    """A session chat turn (Sessions.chat's answer) as an Anthropic Message, the farm's view under `farm`."""
    choice, farm = out["choices"][0], out["farm"]
    content = blocks(choice["message"])
    reason, stop = {"tool_calls": "tool_use", "length": "max_tokens"}.get(choice["finish_reason"], "end_turn"), None
    if reason == "end_turn" and choice["finish_reason"] == "stop":
        text = "".join(b["text"] for b in content if b["type"] == "text")
        if stop := stopped_by(text, req.stop_sequences):
            reason = "stop_sequence"
    return {
        "id": f"msg_{farm['session_id']}_{farm['segment_id']}_{farm['turn']}",
        "type": "message",
        "role": "assistant",
        "model": out["model"],
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": {"input_tokens": out["usage"]["prompt_tokens"], "output_tokens": out["usage"]["completion_tokens"]},
        "farm": {**farm, "finish_reason": choice["finish_reason"]},
    }
