"""OpenAI's Responses API as a session's chat turn: the input items read into the session's chat messages and
function tools, the turn taken by Sessions.chat (the same tokens, loss mask, forks and retries as the chat route:
nothing is stored twice), and its chat completion written back as a Response.

History, as a chat template takes it:
  previous_response_id              that turn's messages and its answer, from the session (`resp_{session}_{segment}_
                                    {turn}` names them); `instructions` replace its system message, or lead it
  instructions                      a system message, first
  message items                     a message each (developer as system; parts joined)
  reasoning, message, function_call one assistant message: reasoning_content, content, tool_calls (as the farm
  (a run of them)                   answers a turn: the same order)
  function_call_output              a tool message answering call_id (a call earlier in the history)

The answer's output: a reasoning item for the turn's reasoning (its reasoning_content, else a leading <think> block), a
message with the text, a function_call per call; status incomplete (max_output_tokens) when the turn hit its limit;
the farm's token view under `farm`.
"""

from __future__ import annotations

import time

from rollout_farm.services.episodes.chat_turns import (
    door_tools,
    function_tool,
    invalid,
    renamed,
    the_one_tool,
    thinking_and_text,
)
from rollout_farm.services.episodes.session_store import Session
from rollout_farm.services.errors import Invalid
from rollout_farm.services.protocol import responses as R
from rollout_farm.services.protocol import sessions as S

CHAT_FIELDS = {"tool_choice.function.name": "tool_choice.name", "max_completion_tokens": "max_output_tokens"}


def response_id(farm: dict) -> str:
    return f"resp_{farm['session_id']}_{farm['segment_id']}_{farm['turn']}"


def previous(session: Session, response: str) -> list[dict]:
    """The history a response of this session closes: its turn's messages and the answer. Another session's, or
    one this session never gave, is a 422 naming previous_response_id."""
    kind, _, rest = response.partition("_")
    sid, segment_id, turn = (rest.split("_") + [None, None])[:3] if kind == "resp" else (None, None, None)
    if sid != session.id:
        raise invalid("previous_response_id", f"{response!r} is not a response of session {session.id}")
    segment = next((s for s in session.segments if s.id == segment_id), None)
    if segment is None or not (turn or "").isdigit() or int(turn) >= len(segment.turns):
        raise invalid("previous_response_id", f"session {session.id} gave no response {response!r}")
    return [as_sent(m) for m in segment.messages[: segment.turns[int(turn)].prompt_messages + 1]]


def as_sent(message: dict) -> dict:
    """A stored message as a client sends it: text parts (kept as `content_parts` beside the joined content, for the
    history match) as parts again."""
    out = {k: v for k, v in message.items() if k != "content_parts"}
    if "content_parts" in message:
        out["content"] = [{"type": "text", "text": p} for p in message["content_parts"]]
    return out


def chat_request(req: R.ResponsesRequest, history: list[dict]) -> S.SessionChatRequest:
    """The session chat turn this request asks for, after `history` (a previous response's; [] without one)."""
    return S.SessionChatRequest(
        model=req.model,
        messages=[S.SessionMessage(**m) for m in chat_messages(req, history)],
        tools=door_tools(function_tools(req.tools), "parameters"),
        tool_choice=tool_choice(req),
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
    )


def renamed_error(e: Invalid) -> Invalid:
    return renamed(e, CHAT_FIELDS)


def text_of(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def chat_messages(req: R.ResponsesRequest, history: list[dict]) -> list[dict]:
    out = list(history)
    if req.instructions is not None:
        system = {"role": "system", "content": req.instructions}
        out = [system, *out[1:]] if out and out[0]["role"] == "system" else [system, *out]
    calls = {c["id"] for m in out for c in m.get("tool_calls") or []}
    items = [R.MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    turn: dict | None = None  # the assistant message a run of reasoning, message and function_call items builds
    for i, item in enumerate(items):
        if item.type == "reasoning" or item.type == "function_call" or getattr(item, "role", "") == "assistant":
            said = turn is not None and (turn["content"] or turn.get("tool_calls"))
            if turn is None or item.type == "reasoning" or (item.type == "message" and said):
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            if item.type == "reasoning":
                turn["reasoning_content"] = "".join(c.text for c in item.content or [])
            elif item.type == "message":
                turn["content"] = text_of(item.content)
            else:
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                turn.setdefault("tool_calls", []).append(call)
                calls.add(item.call_id)
            continue
        turn = None
        if item.type == "function_call_output":
            if item.call_id not in calls:
                raise invalid(f"input.{i}.call_id", f"{item.call_id!r} is the call_id of no function_call before it")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
        else:
            out.append({"role": "system" if item.role == "developer" else item.role, "content": text_of(item.content)})
    if not out:
        raise invalid("input", "no input items and no previous_response_id: give the message the model answers")
    return out


def function_tools(tools: list[R.FunctionTool] | None) -> list[dict] | None:
    if tools is None:
        return None
    return [function_tool(t.name, t.description, t.parameters or {"type": "object", "properties": {}}) for t in tools]


def tool_choice(req: R.ResponsesRequest):
    names = [t.name for t in req.tools or []]
    if req.tool_choice in ("auto", "none"):
        return req.tool_choice
    if req.tool_choice == "required":
        name = the_one_tool(names, "tool_choice", "required", "{type: function, name}")
    else:
        name = req.tool_choice.name
    if name not in names:
        raise invalid("tool_choice.name", f"{name!r} is not one of the request's tools")
    return {"type": "function", "function": {"name": name}}


def output(message: dict, base: str) -> list[dict]:
    """The answer's output items: reasoning, the message, a function_call per call."""
    thinking, text = thinking_and_text(message)
    out = []
    if thinking:
        reasoning = [{"type": "reasoning_text", "text": thinking}]
        out.append(
            {"type": "reasoning", "id": f"rs_{base}", "summary": [], "content": reasoning, "status": "completed"}
        )
    if text:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        out.append(
            {"type": "message", "id": f"msg_{base}", "role": "assistant", "status": "completed", "content": [part]}
        )
    for k, call in enumerate(message.get("tool_calls") or []):
        f = call["function"]
        out.append(
            {
                "type": "function_call",
                "id": f"fc_{base}_{k}",
                "call_id": call["id"],
                "name": f["name"],
                "arguments": f["arguments"],
                "status": "completed",
            }
        )
    return out


def response(out: dict, req: R.ResponsesRequest) -> dict:
    """A session chat turn (Sessions.chat's answer) as a Response, the farm's view under `farm`."""
    choice, farm = out["choices"][0], out["farm"]
    rid = response_id(farm)
    cut = choice["finish_reason"] == "length"
    usage = out["usage"]
    return {
        "id": rid,
        "object": "response",
        "created_at": float(out["created"]),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "instructions": req.instructions,
        "model": out["model"],
        "output": output(choice["message"], rid.removeprefix("resp_")),
        "parallel_tool_calls": True,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump(),
        "tools": [t.model_dump(exclude_none=True) | {"strict": False} for t in req.tools or []],
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "store": True,
        "metadata": {},
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
        "farm": {**farm, "finish_reason": choice["finish_reason"]},
        "completed_at": time.time(),
    }
