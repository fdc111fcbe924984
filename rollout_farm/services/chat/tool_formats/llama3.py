"""llama3-json: Llama 3.1/3.2/3.3's JSON calls, `{"name": ..., "parameters": {...}}` as the whole turn, after an
optional `<|python_tag|>` (a special token: read by id). The templates render one call per turn (they refuse more);
parallel calls are read as SGLang's and vLLM's Llama parsers read them, objects separated by `;`. Llama 3.1's
built-in tools (`<|python_tag|>brave_search.call(query="...")`, only with `builtin_tools`) are not read: such a turn
is malformed.
"""

from __future__ import annotations

import json

from rollout_farm.services.chat.tool_formats.base import TOOL_FORMATS, ParsedTurn, ToolCall, ToolFormat, checked

DECODER = json.JSONDecoder()


def objects(text: str) -> list | str:
    """The JSON values in `text`, separated by `;`, or why it is not such a list."""
    found, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        try:
            obj, at = DECODER.raw_decode(text, at)
        except json.JSONDecodeError as e:
            return f"not JSON ({e.msg} at character {e.pos})"
        found.append(obj)
        rest = text[at:].lstrip()
        if not rest:
            return found
        if not rest.startswith(";"):
            return f"text after a call at character {at}: calls are separated by ';'"
        at = len(text) - len(rest) + 1


def read_object(obj) -> tuple[str, str] | str:
    if not isinstance(obj, dict):
        return 'not an object: a call is {"name": "...", "parameters": {...}}'
    return checked(obj.get("name"), obj.get("parameters", obj.get("arguments", {})))


@TOOL_FORMATS.register("llama3-json")
class Llama3Json(ToolFormat):
    name = "llama3-json"
    markers = ("<|python_tag|>",)

    def read(self, text: str, turn: int) -> ParsedTurn:
        tag = self.mark("<|python_tag|>")
        if tag in text:
            content, action = text.split(tag, 1)
        elif text.lstrip().startswith('{"name"'):
            content, action = "", text
        else:
            return ParsedTurn(text.strip())
        found = objects(action.strip())
        got = [read_object(o) for o in found] if isinstance(found, list) else [found]
        if bad := [g for g in got if isinstance(g, str)]:
            return ParsedTurn(text.strip(), [], bad[:1])
        return ParsedTurn(content.strip(), [ToolCall(self.call_id(turn, i), *g) for i, g in enumerate(got)])

    def render_call(self, name: str, arguments: dict) -> str:
        return f'{{"name": "{name}", "parameters": {json.dumps(arguments, ensure_ascii=False)}}}'

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "; ".join(self.render_call(name, arguments) for name, arguments in calls)

    def opening(self, name: str) -> str:
        return f'{{"name": "{name}", "parameters": '
