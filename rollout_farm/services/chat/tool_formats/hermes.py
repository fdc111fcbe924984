"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, a block per call (parallel calls: several
blocks). What the Qwen2.5 and Qwen3 chat templates render (and Hermes 2/3's), and verl's HermesToolParser reads.
Qwen's tokenizers have `<tool_call>` and `</tool_call>` as single (added) tokens: read by id there.
"""

from __future__ import annotations

import json
import re

from rollout_farm.services.chat.tool_formats.base import TOOL_FORMATS, ParsedTurn, ToolCall, ToolFormat, read_call


@TOOL_FORMATS.register("hermes")
class Hermes(ToolFormat):
    name = "hermes"
    markers = ("<tool_call>", "</tool_call>")
    BLOCK = re.compile("\ue000(.*?)\ue001", re.DOTALL)  # the markers' sentinels (base.py)
    OPEN, CLOSE = "\ue000", "\ue001"

    def read(self, text: str, turn: int) -> ParsedTurn:
        calls, malformed, kept, last = [], [], [], 0
        for match in self.BLOCK.finditer(text):
            got = self.read_block(match.group(1).strip())
            if isinstance(got, str):
                malformed.append(got)
                continue
            kept.append(text[last : match.start()])
            last = match.end()
            calls.append(ToolCall(self.call_id(turn, len(calls)), *got))
        rest = text[last:]
        if self.OPEN in rest.rsplit(self.CLOSE, 1)[-1]:
            malformed.append("a <tool_call> without its </tool_call>")
        return ParsedTurn("".join(kept + [rest]).strip(), calls, malformed)

    def read_block(self, body: str) -> tuple[str, str] | str:
        """(name, arguments as JSON text) from a block's body, or why it does not read."""
        return read_call(body)

    def render_call(self, name: str, arguments: dict) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n</tool_call>'

    def opening(self, name: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '
