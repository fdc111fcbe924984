"""Messages through the tokenizer's chat template (`render`), and a prompt's token ids (`prompt_ids`).

The OpenAI chat route renders its messages with `render` (rollout_farm/services/chat/renderer.py), a session turn
renders only what it adds (rollout_farm/services/chat/delta.py), and a replica tokenizes a rollout's prompts with
`prompt_ids` (rollout_farm/services/replica/group_sampling.py): one function each, wherever they run.
"""

from __future__ import annotations

import json

from rollout_farm.services import protocol as P


def render(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, generation_prompt: bool = True
) -> str | None:
    """Messages (and `tools`, as the template renders them) through the tokenizer's chat template, ready for
    generation unless `generation_prompt` is False; None without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
    )


def for_template(messages: list[dict]) -> list[dict]:
    """The messages as Hugging Face chat templates take them: a call's arguments as an object (OpenAI sends text).
    Arguments that are not JSON (the model wrote what it wrote) stay text, for the template to render as it
    renders a string (Qwen3's as it is)."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = as_object(call["function"]["arguments"])
    return out


def as_object(arguments: str) -> object:
    """Arguments parsed from JSON; the text itself when it is not JSON."""
    try:
        return json.loads(arguments or "{}")
    except ValueError:
        return arguments


def prompt_ids(tokenizer, prompt: P.Prompt) -> list[int]:
    """A prompt's token ids: as given, or its text tokenized without special tokens."""
    if prompt.token_ids is not None:
        return prompt.token_ids
    return tokenizer(prompt.text, add_special_tokens=False).input_ids
