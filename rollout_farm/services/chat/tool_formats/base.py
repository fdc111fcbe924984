"""What every tool format shares: a call, a parsed turn, the format's base class and registry, and reading a turn's
markers by token id.

A format's calls are made of markers (`<tool_call>`, `[TOOL_CALLS]`, `<|call|>`): special tokens in the families that
have them. A model can also write a marker's text as ordinary characters (other tokens); that is text, not a call.
So a sampled turn is read from its token ids: each marker token becomes one private-use character (its sentinel),
every other id is decoded as the engine decodes a sample (special tokens skipped), and the format's `read` finds the
calls between sentinels. A marker that is no single token of the tokenizer (a format used with another family's
model, the embedded byte-level model) is read by its text; so is a turn given as text alone (`parse`).
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import ClassVar

from rollout_farm.services.chat.tool_schemas import NAME
from rollout_farm.services.extensions.registry import Registry

SENTINEL = 0xE000  # marker k reads as chr(SENTINEL + k): a private-use character no template writes


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
    reasoning: str = ""  # what a format reads as reasoning apart from the content (harmony's analysis channel)


class ToolFormat(abc.ABC):
    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # the tokens its calls are made of, read by token id where single tokens

    def parse(self, text: str, turn: int) -> ParsedTurn:
        """The calls in a sampled turn's text (turn: the turn's index, for the call ids); markers by their text."""
        return self.unmarked(self.read(self.marked_text(text), turn))

    def parse_ids(self, ids: list[int], tokenizer, turn: int) -> ParsedTurn:
        """The calls in a sampled turn's token ids: a marker only where the model sampled its token."""
        return self.unmarked(self.read(self.marked_ids(ids, tokenizer), turn))

    @abc.abstractmethod
    def read(self, text: str, turn: int) -> ParsedTurn:
        """The calls in a turn's text whose markers are sentinels (`mark`)."""

    @abc.abstractmethod
    def render_call(self, name: str, arguments: dict) -> str:
        """The text the model writes for one call."""

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        """The text the model writes for parallel calls in one turn."""
        return "\n".join(self.render_call(name, arguments) for name, arguments in calls)

    @abc.abstractmethod
    def opening(self, name: str) -> str:
        """A call's text up to its arguments: appended as context when tool_choice names the function."""

    def call_id(self, turn: int, index: int) -> str:
        """Call `index` of turn `turn`'s id: the same for a retried turn."""
        return f"call_{turn}_{index}"

    def mark(self, marker: str) -> str:
        return chr(SENTINEL + self.markers.index(marker))

    def marked_text(self, text: str) -> str:
        for marker in sorted(self.markers, key=len, reverse=True):  # `<|end|>` inside no longer marker
            text = text.replace(marker, self.mark(marker))
        return text

    def marked_ids(self, ids: list[int], tokenizer) -> str:
        single = {m: tokenizer.encode(m, add_special_tokens=False) for m in self.markers}
        by_id = {got[0]: self.mark(m) for m, got in single.items() if len(got) == 1}
        parts, run = [], []
        for i in ids:
            if i in by_id:
                parts += [tokenizer.decode(run, skip_special_tokens=True), by_id[i]]
                run = []
            else:
                run.append(i)
        text = "".join([*parts, tokenizer.decode(run, skip_special_tokens=True)])
        for marker, got in single.items():
            if len(got) != 1:
                text = text.replace(marker, self.mark(marker))
        return text

    def unmark(self, text: str) -> str:
        for marker in self.markers:
            text = text.replace(self.mark(marker), marker)
        return text

    def unmarked(self, parsed: ParsedTurn) -> ParsedTurn:
        return ParsedTurn(self.unmark(parsed.content), parsed.calls, parsed.malformed, self.unmark(parsed.reasoning))


TOOL_FORMATS: Registry[type[ToolFormat]] = Registry("tool format", ToolFormat)


def read_call(body: str, arguments: str = "arguments") -> tuple[str, str] | str:
    """(name, arguments as JSON text) from a call's JSON body (`arguments`: the key its arguments are under), or why
    it does not read."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at character {e.pos})"
    if not isinstance(call, dict):
        return f'not an object: a call is {{"name": "...", "{arguments}": {{...}}}}'
    return checked(call.get("name"), call.get(arguments, {}))


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
