"""Mistral's calls, after the special token `[TOOL_CALLS]` (read by id, as `[ARGS]` and `[CALL_ID]`):

  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`: a JSON list, parallel calls in one list
               (Mistral 7B v0.3, Nemo: tokenizer v3)
  mistral-v11  `[TOOL_CALLS]NAME[ARGS]{...}`, one `[TOOL_CALLS]` per call (Small 3.2, Devstral, Magistral,
               Ministral 3: tokenizer v11 and later; the template also writes `[CALL_ID]id` before `[ARGS]`)

Both read both shapes (a model writes what it writes). Mistral's templates refuse a tool call id that is not 9
letters or digits, so the calls' ids are 9 characters (`c` + turn + call).
"""

from __future__ import annotations

import json

from rollout_farm.services.chat.tool_formats.base import TOOL_FORMATS, ParsedTurn, ToolCall, ToolFormat, checked

DECODER = json.JSONDecoder()


@TOOL_FORMATS.register("mistral")
class Mistral(ToolFormat):
    name = "mistral"
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def read(self, text: str, turn: int) -> ParsedTurn:
        content, *blocks = text.split(self.mark("[TOOL_CALLS]"))
        got, rest = [], []
        for block in blocks:
            calls, after = self.read_block(block)
            got += calls
            rest.append(after)
        malformed = [g for g in got if isinstance(g, str)]
        if malformed:
            return ParsedTurn(text.strip(), [], malformed)
        calls = [ToolCall(self.call_id(turn, i), *g) for i, g in enumerate(got)]
        return ParsedTurn("".join([content, *rest]).strip(), calls)

    def read_block(self, block: str) -> tuple[list, str]:
        """The calls after one `[TOOL_CALLS]` (each (name, arguments) or why not), and the text after them."""
        if block.lstrip().startswith("["):
            try:
                found, at = DECODER.raw_decode(block.lstrip())
            except json.JSONDecodeError as e:
                return [f"not JSON ({e.msg} at character {e.pos})"], ""
            if not isinstance(found, list):
                return ["not a list of calls"], ""
            return [read_object(o) for o in found], block.lstrip()[at:]
        name, args, found = block.partition(self.mark("[ARGS]"))
        if not args:
            return ["a [TOOL_CALLS] without [ARGS]"], ""
        name = name.split(self.mark("[CALL_ID]"))[0].strip()
        try:
            arguments, at = DECODER.raw_decode(found.lstrip())
        except json.JSONDecodeError as e:
            return [f"the arguments of {name[:80]!r} are not JSON ({e.msg})"], ""
        return [checked(name, arguments)], found.lstrip()[at:]

    def call_id(self, turn: int, index: int) -> str:
        return f"c{turn:05d}{index:03d}"  # 9 letters or digits, as Mistral's templates require

    def render_call(self, name: str, arguments: dict) -> str:
        return self.render_calls([(name, arguments)])

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        listed = [{"name": name, "arguments": arguments} for name, arguments in calls]
        return f"[TOOL_CALLS]{json.dumps(listed, ensure_ascii=False)}"

    def opening(self, name: str) -> str:
        return f'[TOOL_CALLS][{{"name": "{name}", "arguments": '


def read_object(obj) -> tuple[str, str] | str:
    if not isinstance(obj, dict):
        return 'not an object: a call is {"name": "...", "arguments": {...}}'
    return checked(obj.get("name"), obj.get("arguments", {}))


@TOOL_FORMATS.register("mistral-v11")
class MistralV11(Mistral):
    name = "mistral-v11"

    def render_call(self, name: str, arguments: dict) -> str:
        return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments, ensure_ascii=False)}"

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "".join(self.render_call(name, arguments) for name, arguments in calls)

    def opening(self, name: str) -> str:
        return f"[TOOL_CALLS]{name}[ARGS]"
