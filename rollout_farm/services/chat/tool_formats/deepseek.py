"""DeepSeek's calls, between special tokens (read by id): `<｜tool▁calls▁begin｜>`, then per call
`<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`; parallel calls: several in the block.

  deepseek-v3    a call is `function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` (V3, R1 and its distills)
  deepseek-v3.1  a call is `NAME<｜tool▁sep｜>{...}` (V3.1)

Both read both shapes.
"""

from __future__ import annotations

import json
import re

from rollout_farm.services.chat.tool_formats.base import TOOL_FORMATS, ParsedTurn, ToolCall, ToolFormat, checked

BEGIN, CALL, SEP, CALL_END, END = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
FENCED = re.compile(r"^([^\n]*)\n```(?:json)?\n(.*)\n```\s*$", re.DOTALL)


@TOOL_FORMATS.register("deepseek-v3")
class DeepSeekV3(ToolFormat):
    name = "deepseek-v3"
    markers = (BEGIN, CALL, SEP, CALL_END, END)

    def read(self, text: str, turn: int) -> ParsedTurn:
        begin, end, call, call_end = (self.mark(m) for m in (BEGIN, END, CALL, CALL_END))
        content, *blocks = text.split(begin)
        kept, got = [content], []
        for block in blocks:
            block, closed, after = block.partition(end)
            found = [self.read_call(part.split(call_end)[0]) for part in block.split(call)[1:]]
            if not closed or block.count(call) != block.count(call_end):
                found.append(f"a {BEGIN} without its {END}" if not closed else f"a {CALL} without its {CALL_END}")
            got += found or [f"a {BEGIN} with no call"]
            kept.append(after)
        if bad := [g for g in got if isinstance(g, str)]:
            return ParsedTurn(text.strip(), [], bad)
        return ParsedTurn("".join(kept).strip(), [ToolCall(self.call_id(turn, i), *g) for i, g in enumerate(got)])

    def read_call(self, part: str) -> tuple[str, str] | str:
        head, sep, body = part.partition(self.mark(SEP))
        if not sep:
            return f"a call without {SEP}"
        fenced = FENCED.match(body)
        if fenced and head.strip() == "function":
            return checked(fenced.group(1).strip(), fenced.group(2))
        return checked(head.strip(), body.strip())

    def render_call(self, name: str, arguments: dict) -> str:
        return self.render_calls([(name, arguments)])

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return (
            BEGIN
            + "\n".join(self.one(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls)
            + END
        )

    def one(self, name: str, arguments: str) -> str:
        return f"{CALL}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"

    def opening(self, name: str) -> str:
        return f"{BEGIN}{CALL}function{SEP}{name}\n```json\n"


@TOOL_FORMATS.register("deepseek-v3.1")
class DeepSeekV31(DeepSeekV3):
    name = "deepseek-v3.1"

    def one(self, name: str, arguments: str) -> str:
        return f"{CALL}{name}{SEP}{arguments}{CALL_END}"

    def opening(self, name: str) -> str:
        return f"{BEGIN}{CALL}{name}{SEP}"
