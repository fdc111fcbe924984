"""Tool-call formats: how a model writes a tool call in its text, and how the farm reads it back as OpenAI
`tool_calls`. One registry, TOOL_FORMATS, like the samplers'; `pkg.module:Class` for a format in a FARM_PLUGINS
module.

  hermes  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, a block per call: what the Qwen2.5 and Qwen3
          chat templates render and verl's HermesToolParser reads
  plain   a line per call, `call NAME {json arguments}`: for models without a chat template (the embedded
          byte-level model)

A call that opens but does not read (bad JSON, no name, arguments not an object, no closing tag) is malformed: it
becomes no tool call, the reason is kept for the metrics, and the text stays in the content. Parsing never raises.
Call ids are the turn's index and the call's, so that a retried turn parses to the same ids.
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass, field
from typing import ClassVar

from rollout_farm.services.chat.tool_schemas import NAME
from rollout_farm.services.extensions.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text of an object, as OpenAI sends it

    def openai(self) -> dict:
        """The call as an OpenAI chat message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the text without the calls that were read
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # why each call that did not read was refused


class ToolFormat(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def parse(self, text: str, turn: int) -> ParsedTurn:
        """The calls in a sampled turn's text (turn: the turn's index, for the call ids)."""

    @abc.abstractmethod
    def render_call(self, name: str, arguments: dict) -> str:
        """The text the model writes for one call."""

    @abc.abstractmethod
    def opening(self, name: str) -> str:
        """A call's text up to its arguments: appended as context when tool_choice names the function."""


TOOL_FORMATS: Registry[type[ToolFormat]] = Registry("tool format", ToolFormat)


def read_call(body: str) -> tuple[str, str] | str:
    """(name, arguments as JSON text) from a call's JSON body, or why it does not read."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at character {e.pos})"
    if not isinstance(call, dict):
        return 'not an object: a call is {"name": "...", "arguments": {...}}'
    return checked(call.get("name"), call.get("arguments", {}))


def checked(name, arguments) -> tuple[str, str] | str:
    """(name, arguments as JSON text), or why they do not make a call. Arguments may come as an object or as the JSON
    text of one (as OpenAI sends them)."""
    if not isinstance(name, str) or not name:
        return 'no "name": a call is {"name": "...", "arguments": {...}}'
    if not NAME.match(name):
        return f"the name {name[:80]!r} is no function name (1-64 letters, digits, '_' or '-')"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"the arguments of {name!r} are not JSON"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} are not an object"
    return name, json.dumps(arguments, ensure_ascii=False)


@TOOL_FORMATS.register("hermes")
class Hermes(ToolFormat):
    name = "hermes"
    BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    OPEN = "<tool_call>"

    def parse(self, text: str, turn: int) -> ParsedTurn:
        calls, malformed, kept, last = [], [], [], 0
        for match in self.BLOCK.finditer(text):
            got = read_call(match.group(1).strip())
            if isinstance(got, str):
                malformed.append(got)
                continue
            kept.append(text[last : match.start()])
            last = match.end()
            calls.append(ToolCall(f"call_{turn}_{len(calls)}", *got))
        rest = text[last:]
        if self.OPEN in rest.rsplit("</tool_call>", 1)[-1]:
            malformed.append("a <tool_call> without its </tool_call>")
        return ParsedTurn("".join(kept + [rest]).strip(), calls, malformed)

    def render_call(self, name: str, arguments: dict) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n</tool_call>'

    def opening(self, name: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '


@TOOL_FORMATS.register("plain")
class Plain(ToolFormat):
    name = "plain"
    LINE = re.compile(r"^call (\S+) (.*)$")

    def parse(self, text: str, turn: int) -> ParsedTurn:
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
                calls.append(ToolCall(f"call_{turn}_{len(calls)}", *got))
        return ParsedTurn("\n".join(kept).strip(), calls, malformed)

    def render_call(self, name: str, arguments: dict) -> str:
        return f"call {name} {json.dumps(arguments, separators=(',', ':'))}"

    def opening(self, name: str) -> str:
        return f"call {name} "
