"""Tool-call formats: how a model writes a tool call in its text, and how the farm reads it back as OpenAI
`tool_calls`. One registry, TOOL_FORMATS, like the samplers'; `pkg.module:Class` for a format in a FARM_PLUGINS
module. A file per family:

| format | file | a call | model families |
| --- | --- | --- | --- |
| `hermes` | `hermes.py` | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` | Qwen2.5, Qwen3, Hermes 2/3 |
| `qwen3-xml` | `qwen3_xml.py` | `<tool_call><function=NAME><parameter=P>v</parameter></function></tool_call>` | Qwen3-Coder, Qwen3.5 |
| `llama3-json` | `llama3.py` | `<|python_tag|>{"name": ..., "parameters": {...}}` (the tag optional) | Llama 3.1/3.2/3.3 |
| `mistral` | `mistral.py` | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` | Mistral 7B v0.3, Nemo |
| `mistral-v11` | `mistral.py` | `[TOOL_CALLS]NAME[ARGS]{...}` | Mistral Small 3.2, Devstral, Magistral |
| `deepseek-v3` | `deepseek.py` | `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + fenced JSON | DeepSeek V3, R1 |
| `deepseek-v3.1` | `deepseek.py` | `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}` | DeepSeek V3.1 |
| `harmony` | `harmony.py` | `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` | gpt-oss |
| `plain` | `plain.py` | a line `call NAME {json}` | models without a chat template |

`base.py` holds what they share (a call, a parsed turn, reading a turn's marker tokens by id), `detect.py` the
format a tokenizer's chat template renders (a session's `tool_format` "auto").

A call that opens but does not read (bad JSON, no name, arguments not an object, no closing marker) is malformed: it
becomes no tool call, the reason is kept for the metrics, and the text stays in the content. Parsing never raises.
Call ids are the turn's index and the call's, so that a retried turn parses to the same ids.
"""

from rollout_farm.services.chat.tool_formats import deepseek, harmony, llama3, mistral, qwen3_xml  # noqa: F401
from rollout_farm.services.chat.tool_formats.base import (
    TOOL_FORMATS,
    ParsedTurn,
    ToolCall,
    ToolFormat,
    checked,
    read_call,
)
from rollout_farm.services.chat.tool_formats.detect import AUTO, detected
from rollout_farm.services.chat.tool_formats.hermes import Hermes
from rollout_farm.services.chat.tool_formats.plain import Plain

__all__ = [
    "AUTO",
    "TOOL_FORMATS",
    "Hermes",
    "ParsedTurn",
    "Plain",
    "ToolCall",
    "ToolFormat",
    "checked",
    "detected",
    "read_call",
]
