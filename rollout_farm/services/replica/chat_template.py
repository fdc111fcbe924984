"""What the chat verbs do with a tokenizer alone: render messages through its chat template (`render`), and a
session turn's context ids (`chat_turn`). The engine replica runs them as its render_chat and chat_turn verbs, and
the ingress with the replicas' tokenizer (rollout_farm/services/compat/chat_render.py), so both render alike.
"""

from __future__ import annotations

from rollout_farm.services.episodes import chat_delta


def render(tokenizer, messages: list[dict]) -> str | None:
    """Messages through the tokenizer's chat template, ready for generation; None without a template."""
    if not tokenizer.chat_template:
        return None
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_turn(
    tokenizer, held_tail: list[int], after_sampled: bool, new: list[dict], tools: list[dict], opens: bool, forced: str
) -> dict:
    """A session turn's context ids as [close, messages, prompt, forced] (rollout_farm/services/episodes/chat_delta.py),
    or {"error": why} when the template has no exact continuation for these messages."""
    try:
        parts = chat_delta.turn_context(tokenizer, held_tail, after_sampled, chat_delta.for_template(new), tools, opens)
    except Exception as e:  # NotAppendOnly, or the template's own error (a role it refuses)
        return {"error": str(e) or type(e).__name__}
    return {"ids": [*parts, tokenizer.encode(forced, add_special_tokens=False) if forced else []]}
