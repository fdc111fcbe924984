"""qwen3-xml: the XML-style calls of Qwen3-Coder and Qwen3.5, `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue
\\n</parameter>\\n</function>\\n</tool_call>`, a block per call (parallel calls: several blocks). `<tool_call>` and
`</tool_call>` are single tokens there: read by id.

The template writes a string value as it is and any other value as JSON; without the tool's schema a value reads
back as JSON where it is JSON (a number, true, an object) and as the string otherwise, so the string "42" reads as
the number 42 (SGLang's Qwen3CoderDetector converts by the schema; docs/data/tool_parse_parity.json counts this).
"""

from __future__ import annotations

import json
import re

from rollout_farm.services.chat.tool_formats.base import TOOL_FORMATS, checked
from rollout_farm.services.chat.tool_formats.hermes import Hermes

FUNCTION = re.compile(r"^\s*<function=([^>\n]*)>(.*?)</function>\s*$", re.DOTALL)
PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>\s*", re.DOTALL)


def value(text: str):
    """A parameter's value: JSON where it reads as JSON, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_xml(body: str) -> tuple[str, str] | str:
    """(name, arguments as JSON text) from a block's `<function=...>` body, or why it does not read."""
    match = FUNCTION.match(body)
    if not match:
        return "not <function=NAME>...</function>"
    name, params = match.groups()
    arguments, at = {}, 0
    while p := PARAMETER.match(params, at):  # anchored where the last one ended: one scan of the text in all
        arguments[p.group(1)], at = value(p.group(2)), p.end()
    if params[at:].strip():
        return f"the parameters of {name[:80]!r} are not <parameter=P>value</parameter> blocks"
    return checked(name, arguments)


@TOOL_FORMATS.register("qwen3-xml")
class Qwen3Xml(Hermes):
    name = "qwen3-xml"

    def read_block(self, body: str) -> tuple[str, str] | str:
        return read_xml(body)

    def render_call(self, name: str, arguments: dict) -> str:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
            for k, v in arguments.items()
        )
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"

    def opening(self, name: str) -> str:
        return f"<tool_call>\n<function={name}>\n"
