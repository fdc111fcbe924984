"""harmony: gpt-oss's messages, `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>`. A sampled turn may hold several messages (it opens after the generation prompt
`<|start|>assistant`): the analysis channel is reasoning, the final channel (and commentary to no one) is the
content, a message to `functions.NAME` is a call. Every marker is a special token of o200k_harmony: read by id. The
template renders one call per assistant message and the model stops at `<|call|>`: one call per turn.
"""

from __future__ import annotations

import json
import re

from rollout_farm.services.chat.tool_formats.base import TOOL_FORMATS, ParsedTurn, ToolCall, ToolFormat, checked

RECIPIENT = re.compile(r"\bto=([\w.\-]+)")
CHANNEL = re.compile(r"^\s*(\w+)")


@TOOL_FORMATS.register("harmony")
class Harmony(ToolFormat):
    name = "harmony"
    markers = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")

    def read(self, text: str, turn: int) -> ParsedTurn:
        message = self.mark("<|message|>")
        content, reasoning, calls, malformed = [], [], [], []
        for chunk in text.split(self.mark("<|start|>")):
            if message not in chunk:
                content.append(chunk)  # text outside harmony's messages
                continue
            header, body = chunk.split(message, 1)
            body = re.split("[" + "".join(self.mark(m) for m in ("<|end|>", "<|call|>", "<|return|>")) + "]", body)[0]
            header = header.replace(self.mark("<|constrain|>"), " ")
            channel = header.split(self.mark("<|channel|>"), 1)[1] if self.mark("<|channel|>") in header else ""
            to = RECIPIENT.search(header)
            if to and to.group(1).startswith("functions."):
                got = checked(to.group(1).removeprefix("functions."), body.strip() or "{}")
                if isinstance(got, str):
                    malformed.append(got)
                    content.append(body)
                else:
                    calls.append(ToolCall(self.call_id(turn, len(calls)), *got))
            elif to:
                malformed.append(f"a message to {to.group(1)[:80]!r}, not to a function (functions.NAME)")
            elif (m := CHANNEL.match(channel)) and m.group(1) == "analysis":
                reasoning.append(body)
            else:
                content.append(body)
        return ParsedTurn("".join(content).strip(), calls, malformed, "".join(reasoning).strip())

    def render_call(self, name: str, arguments: dict) -> str:
        return f"{self.opening(name)}{json.dumps(arguments, ensure_ascii=False)}<|call|>"

    def opening(self, name: str) -> str:
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
