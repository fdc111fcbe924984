"""plain: a line per call, `call NAME {json arguments}`: for models without a chat template (the embedded
byte-level model). No markers: the text is read as it is.
"""

from __future__ import annotations

import json
import re

from rollout_farm.services.chat.tool_formats.base import TOOL_FORMATS, ParsedTurn, ToolCall, ToolFormat, checked


@TOOL_FORMATS.register("plain")
class Plain(ToolFormat):
    name = "plain"
    LINE = re.compile(r"^call (\S+) (.*)$")

    def read(self, text: str, turn: int) -> ParsedTurn:
        calls, malformed, kept = [], [], []
        for line in text.split("\n"):
            if not line.strip().startswith("call "):
                kept.append(line)
                continue
            match = self.LINE.match(line.strip())
            got = checked(match.group(1), match.group(2)) if match else "not `call NAME {json arguments}`"
            if isinstance(got, str):
                malformed.append(got)
                kept.append(line)
            else:
                calls.append(ToolCall(self.call_id(turn, len(calls)), *got))
        return ParsedTurn("\n".join(kept).strip(), calls, malformed)

    def render_call(self, name: str, arguments: dict) -> str:
        return f"call {name} {json.dumps(arguments, separators=(',', ':'))}"

    def opening(self, name: str) -> str:
        return f"call {name} "
