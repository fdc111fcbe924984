"""A session's OpenAI chat turn, on both sides of the sampling: the request read into chat messages, the turn's
sampling params and a forced call; the sampled turn answered as an OpenAI chat completion with `tool_calls`, and
the farm's token view of it under `farm` (segment, turn, ids, weight versions, malformed calls).
"""

from __future__ import annotations

import re
import time
from dataclasses import replace

from pydantic import ValidationError

from rollout_farm.services import protocol as P
from rollout_farm.services.chat.tool_formats import ParsedTurn, ToolFormat
from rollout_farm.services.chat.tool_schemas import tool_problems
from rollout_farm.services.episodes.segments import THINK, THINK_END, Segment, reasoning_split
from rollout_farm.services.episodes.session_store import Session
from rollout_farm.services.errors import Invalid, pydantic_fields
from rollout_farm.services.protocol import sessions as S


def invalid(field: str, message: str) -> Invalid:
    return Invalid([{"field": field, "message": message}])


def checked_tools(req: S.SessionChatRequest) -> tuple[list[dict], str | None]:
    """The tool definitions (422 on any problem) and the function tool_choice names, if it names one."""
    tools = req.tools or []
    if problems := tool_problems(tools):
        raise Invalid(problems)
    if not isinstance(req.tool_choice, S.NamedToolChoice):
        return tools, None
    name = req.tool_choice.function.name
    if name not in {t["function"]["name"] for t in tools}:
        raise invalid("tool_choice.function.name", f"{name!r} is not one of the request's tools")
    return tools, name


def turn_params(session_params: dict, req: S.SessionChatRequest) -> P.SamplingParams:
    """The session's sampling params with the request's OpenAI overrides."""
    merged = dict(session_params)
    if max_tokens := req.max_completion_tokens or req.max_tokens:
        merged["max_new_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(req, name) is not None:
            merged[name] = getattr(req, name)
    if req.stop is not None:
        merged["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    try:
        return P.SamplingParams(**merged)
    except ValidationError as e:
        raise Invalid(pydantic_fields(e.errors())) from None


def rollout_fields(req: S.SessionChatRequest) -> dict[str, str]:
    """A chat turn's fields for those of the rollout it samples through (a context overflow names them): the prompt
    is the session's tokens and the request's messages, max_new_tokens the max tokens the request gave (or the
    session's, which the request's max_tokens overrides)."""
    limit = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    return {"prompts.0": "messages", "sampling_params.max_new_tokens": limit, "max_new_tokens": limit}


def renamed(e: Invalid, fields: dict[str, str]) -> Invalid:
    """A rollout's 422 with its fields, and their names in the messages, as `fields` map them (a dotted field and
    the ones under it; a bare name in the text)."""

    def field(name: str) -> str:
        for old, new in fields.items():
            if name == old or name.startswith(old + "."):
                return new + name[len(old) :]
        return name

    def text(message: str) -> str:
        for old, new in fields.items():
            if "." not in old:
                message = message.replace(old, new)
        return message

    detail = [{**d, "field": field(d.get("field", "")), "message": text(d.get("message", ""))} for d in e.detail]
    return Invalid(detail, text(e.message))


class ContextFull(Invalid):
    """422: the session's tokens and the new messages leave no room in the model's context for a turn."""

    def __init__(self, room: int):
        super().__init__(
            [{"field": "messages", "message": f"{max(room, 0)} tokens of context left: no room for a turn"}],
            "the session fills the model's context",
        )


def fitted(params: P.SamplingParams, room: int) -> P.SamplingParams:
    """The params with max_new_tokens cut to the room left in the context; ContextFull when there is none."""
    if room < 1:
        raise ContextFull(room)
    return params.model_copy(update={"max_new_tokens": min(params.max_new_tokens, room)})


def parsed_turn(
    fmt: ToolFormat, text: str, turn: int, tool_choice, ids=None, tokenizer=None, thinking: bool = False
) -> ParsedTurn:
    """The sampled text's calls, unless tool_choice is none (then the text is all content). With the sampled `ids`
    (and the tokenizer) the format's markers are read by token id and the text is decoded from them, markers kept
    (the engine's text skips special tokens: rollout_farm/services/chat/tool_formats/base.py). A NUL the model
    sampled is shown as U+FFFD, as undecodable bytes are: no request may carry a NUL, and a client sends this text
    back in its history (the session keeps the sampled ids themselves, whatever the text). `thinking`: the prompt
    opened a <think> block (`opens_thinking`), so the text up to its </think> is the turn's reasoning."""
    marked = fmt.marked_ids(ids, tokenizer) if ids is not None else fmt.marked_text(text)
    marked = marked.replace("\x00", "\ufffd")
    reasoning = ""
    if thinking and THINK_END in marked:
        reasoning, marked = marked.split(THINK_END, 1)
        reasoning, marked = fmt.unmark(reasoning).strip("\n"), marked.lstrip("\n")
    if tool_choice == "none":
        return ParsedTurn(fmt.unmark(marked).strip(), reasoning=reasoning)
    parsed = fmt.unmarked(fmt.read(marked, turn))
    return replace(parsed, reasoning=reasoning) if reasoning else parsed


def opens_thinking(tokenizer, prompt: list[int]) -> bool:
    """Whether a turn's generation prompt ends inside a <think> block it opened (Qwen3.5's, DeepSeek-R1's with
    thinking on): the model writes its reasoning first, closed by </think>, without the opening tag."""
    return bool(prompt) and tokenizer.decode(prompt).rstrip().endswith(THINK)


def assistant_message(parsed: ParsedTurn) -> dict:
    """The sampled turn as the session stores it and answers it: the content, the reasoning a format reads apart from
    it (harmony's analysis channel) as `reasoning_content`, the calls."""
    message = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        message["tool_calls"] = [c.openai() for c in parsed.calls]
    return message


def completion(
    session: Session, head: Segment, index: int, model: str, pieces: list[str] | None, token_ids: bool = False
) -> dict:
    """Turn `index` of a segment as an OpenAI chat completion (a retry gets the same turn again); with `token_ids`,
    vLLM's `prompt_token_ids` and `choices[0].token_ids` too (return_token_ids)."""
    turn = head.turns[index]
    message = head.messages[turn.prompt_messages]
    ids = head.token_ids[turn.start : turn.end]
    choice = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": message["content"] or None,
            **pick(message, "reasoning_content"),
            **pick(message, "tool_calls"),
        },
        "finish_reason": "tool_calls" if turn.tool_calls else turn.finish_reason,
        "logprobs": None,
    }
    if pieces is not None:
        lps = head.logprobs[turn.start : turn.end]
        choice["logprobs"] = {
            "content": [
                {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []} for p, lp in zip(pieces, lps)
            ]
        }
    if token_ids:
        choice["token_ids"] = ids
    return {
        **({"prompt_token_ids": head.token_ids[: turn.start]} if token_ids else {}),
        "id": f"chatcmpl-{session.id}-{head.id}-{index}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": turn.start, "completion_tokens": len(ids), "total_tokens": turn.end},
        "farm": {
            "session_id": session.id,
            "segment_id": head.id,
            "turn": index,
            "token_ids": ids,
            "weight_version": min(head.token_versions[turn.start : turn.end], default=-1),
            "malformed_tool_calls": turn.malformed,
            "trained": bool(ids) and head.loss_mask[turn.start] == 1,
        },
    }


def pick(message: dict, key: str) -> dict:
    return {key: message[key]} if message.get(key) else {}


def thinking_and_text(message: dict) -> tuple[str, str]:
    """An answer's (reasoning, text), as the other front doors answer its reasoning: its `reasoning_content` (what the
    format read apart, harmony's analysis channel), else a leading <think> block of the text, else none and the text
    as sampled."""
    content = message.get("content") or ""
    if message.get("reasoning_content"):
        return message["reasoning_content"], content
    if content.lstrip().startswith(THINK) and THINK_END in content:
        return reasoning_split({"content": content})
    return "", content


def door_tools(tools: list[dict] | None, schema: str) -> list[dict] | None:
    """A front door's tools as OpenAI function tools, each problem a 422 named as that door names its fields
    (`tools.N.name`, `tools.N.<schema>`: input_schema for Anthropic, parameters for Responses)."""
    keys = {"name": "name", "parameters": schema}
    if problems := tool_problems(tools or []):
        field = re.compile(r"^tools\[(\d+)\](?:\.function\.(\w+))?")
        raise Invalid(
            [
                {**p, "field": field.sub(lambda m: f"tools.{m[1]}" + (f".{keys[m[2]]}" if m[2] else ""), p["field"])}
                for p in problems
            ]
        )
    return tools


def function_tool(name: str, description: str | None, parameters: dict) -> dict:
    """A front door's tool as an OpenAI function tool."""
    described = {"description": description} if description is not None else {}
    return {"type": "function", "function": {"name": name, **described, "parameters": parameters}}


def the_one_tool(names: list[str], field: str, asked: str, instead: str) -> str:
    """The tool a door's "call some tool" choice (Anthropic's any, Responses' required) forces: the farm forces a call
    by writing its opening, which names the tool, so there must be one tool; else a 422 naming `field`."""
    if len(names) != 1:
        raise invalid(
            field,
            f"{asked} with {len(names)} tools: the farm forces a call by writing its opening, which names the tool; "
            f"give {instead} (or one tool)",
        )
    return names[0]
