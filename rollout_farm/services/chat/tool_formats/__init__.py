"""Tool-call formats: how a model writes a tool call in its text, and how the farm reads it back as OpenAI
`tool_calls`. One registry, TOOL_FORMATS, like the samplers'; `pkg.module:Class` for a format in a FARM_PLUGINS
module. A file per family:

| module | owns |
| --- | --- |
| `base.py` | a tool call, a parsed turn, `ToolFormat` and `TOOL_FORMATS`; a turn's markers read by token id |
| `hermes.py` | `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes) |
| `qwen3_xml.py` | `qwen3-xml`: `<tool_call><function=NAME><parameter=P>v</parameter>...` (Qwen3-Coder, Qwen3.5) |
| `llama3.py` | `llama3-json`: `<|python_tag|>{"name": ..., "parameters": {...}}`, the tag optional (Llama 3.x) |
| `mistral.py` | `mistral`: `[TOOL_CALLS][{...}]` (Nemo); `mistral-v11`: `[TOOL_CALLS]NAME[ARGS]{...}` (Small 3.2) |
| `deepseek.py` | `deepseek-v3` (V3, R1) and `deepseek-v3.1`: `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>` |
| `harmony.py` | `harmony`: gpt-oss's `<|channel|>commentary to=functions.NAME ...<|message|>{...}<|call|>` |
| `plain.py` | `plain`: a line `call NAME {json}`, for models without a chat template |
| `detect.py` | the format a tokenizer's chat template renders: a session's `tool_format` "auto" |

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
