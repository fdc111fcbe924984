"""The tool format a model writes, told from its tokenizer's chat template: how the template renders an assistant's
tool call is how the model was trained to write one. Fingerprints of the template's text, not model names: a farm
serves whatever folder it is given, fine-tunes and renamed copies included.

A template that renders calls in none of these shapes gets `hermes` (the farm's default before the families were
told apart, and what most open chat templates render); a tokenizer with no chat template gets `plain`.
"""

from __future__ import annotations

AUTO = "auto"

# (format, every string its template contains), first match wins: the more specific shapes first
FINGERPRINTS = [
    ("harmony", ("<|channel|>", "<|call|>")),
    ("deepseek-v3", ("<｜tool▁call▁begin｜>", "```json")),
    ("deepseek-v3.1", ("<｜tool▁call▁begin｜>",)),
    ("mistral-v11", ("[TOOL_CALLS]", "[ARGS]")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("qwen3-xml", ("<tool_call>", "<function=", "<parameter=")),
    ("hermes", ("<tool_call>",)),
    ("llama3-json", ("<|start_header_id|>", '"parameters": ')),
]


def detected(tokenizer) -> str:
    """The tool format the tokenizer's chat template renders."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one, else the tool-use one
        template = template.get("default") or template.get("tool_use") or ""
    if not template:
        return "plain"
    return next((name for name, marks in FINGERPRINTS if all(m in template for m in marks)), "hermes")
