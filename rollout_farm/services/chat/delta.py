"""The tokens a turn adds, rendered through the chat template without rendering the history again.

A chat template renders a whole conversation; a session needs only what comes after the tokens it holds. A short
stand-in history (`STAND_IN`) is rendered alone and then followed by the new messages: the new messages' tokens are
what the second rendering adds to the first. The first's tokens must be a prefix of the second's; where they are
not, the template is not append-only for these messages and the turn is refused (NotAppendOnly), never guessed.

Three pieces, each appended as context (loss mask 0) by rollout_farm/services/episodes/segments.py:
  close     after a sampled assistant turn, the tokens the template ends a turn with that the model did not sample
            (Qwen's "\\n" after <|im_end|>; the whole `<|im_end|>\\n` when max_tokens cut the turn)
  messages  the new messages (tool results, a user's reply), with `tools` rendered as the template does
  prompt    the generation prompt that opens the assistant's turn (`<|im_start|>assistant\\n`)
Reasoning templates (Qwen3's, for one) render a finished assistant turn without its reasoning block once a message
follows it: the stand-in then renders one way alone and another before the new messages. `delta` accepts exactly that
difference, a span dropped from the stand-in's assistant turn before its content (`in_history`), and takes the new
messages' tokens after the stand-in as it renders in the history. The session's own tokens keep what the model
sampled, reasoning included: the trajectory is what the model saw and wrote, where the template would have dropped
the reasoning of earlier turns (docs/episodes.md, "Model families").
The first turn of a session renders its messages whole (`opening`). `turn` is what a session's chat turn asks for
(rollout_farm/services/episodes/sessions.py, through rollout_farm/services/chat/renderer.py): the three pieces, then
the opening of a call that tool_choice forces.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_farm.services.chat.template import for_template, render

STAND_IN = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class NotAppendOnly(ValueError):
    """The template renders the new messages differently after a history than alone: no exact delta exists."""


@dataclass(frozen=True)
class Delta:
    messages: list[int]
    prompt: list[int]


def render_ids(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
    """The chat template's tokens for these messages (the template writes every special token itself)."""
    text = render(tokenizer, messages, tools, generation_prompt)
    if text is None:
        raise NotAppendOnly("the model's tokenizer has no chat template: send token ids (the session's /generate)")
    return tokenizer.encode(text, add_special_tokens=False)


def after(prefix: list[int], full: list[int], what: str) -> list[int]:
    if full[: len(prefix)] != prefix:
        raise NotAppendOnly(f"the chat template does not render {what} as an append to the history")
    return full[len(prefix) :]


def opening(tokenizer, messages: list[dict], tools: list[dict] | None) -> Delta:
    """The first turn's tokens: every message, then the generation prompt."""
    body = render_ids(tokenizer, messages, tools, False)
    return Delta(body, after(body, render_ids(tokenizer, messages, tools, True), "the generation prompt"))


def delta(tokenizer, new: list[dict], tools: list[dict] | None, answered: list[dict] | None = None) -> Delta:
    """The tokens of messages that follow a turn the session already holds, then the generation prompt. Tool results
    that follow calls (`answered`) are rendered after a stand-in that made those calls where the template needs one
    (gpt-oss's names each result by its call)."""
    try:
        return delta_after(tokenizer, STAND_IN, new, tools)
    except Exception:
        if not (answered and new[0]["role"] == "tool"):
            raise
    calls = [
        {"id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": {}}}
        for c in answered
    ]
    return delta_after(tokenizer, [STAND_IN[0], {"role": "assistant", "content": "", "tool_calls": calls}], new, tools)


def delta_after(tokenizer, stand_in: list[dict], new: list[dict], tools: list[dict] | None) -> Delta:
    """The new messages' tokens after `stand_in` as the template renders it in the history (`in_history`)."""
    body = render_ids(tokenizer, stand_in + new, tools, False)
    prompt = after(body, render_ids(tokenizer, stand_in + new, tools, True), "the generation prompt")
    for history in in_history(tokenizer, stand_in, body, tools, prompt):
        if body[: len(history)] == history:
            return Delta(body[len(history) :], prompt)
    raise NotAppendOnly("the chat template does not render these messages as an append to the history")


def in_history(tokenizer, stand_in: list[dict], body: list[int], tools: list[dict] | None, prompt: list[int]):
    """The stand-in's tokens as `body` may render them before the new messages, each exact, tried in turn:
    - alone: the template renders a finished turn as it renders the last one (Qwen2.5, Llama, DeepSeek);
    - less its reasoning: a span of the assistant turn before its content dropped once a message follows it (Qwen3);
    - as before a generation prompt: the last turn rendered as a training target until a message follows it
      (gpt-oss ends it with `<|return|>`, then with `<|end|>`);
    - without the tools: the template writes the tools before the last user message (Mistral), so they move to a
      new user message."""
    alone = render_ids(tokenizer, stand_in, tools, False)
    yield alone
    if stand_in is STAND_IN:
        yield less_reasoning(tokenizer, alone, body, tools)
    ready = render_ids(tokenizer, stand_in, tools, True)
    if prompt and ready[-len(prompt) :] == prompt:
        yield ready[: -len(prompt)]
    if tools:
        yield render_ids(tokenizer, stand_in, None, False)


def less_reasoning(tokenizer, alone: list[int], body: list[int], tools: list[dict] | None) -> list[int]:
    """The stand-in as `body` renders it before the new messages, when that is the stand-in rendered `alone` less one
    span of its assistant turn before the content (a reasoning block the template drops from finished turns); else
    `alone`, and the caller refuses the turn."""
    content = tokenizer.encode(STAND_IN[1]["content"], add_special_tokens=False)
    ending = close(tokenizer, [], tools)
    at = find(alone, content + ending)
    end = find(body, content + ending)
    if at is None or end is None:
        return alone
    kept = body[: end + len(content) + len(ending)]
    dropped = len(alone) - len(kept)
    head = next((i for i in range(min(len(alone), len(kept))) if alone[i] != kept[i]), None)
    if head is None or dropped <= 0 or head + dropped > at or alone[head + dropped :] != kept[head:]:
        return alone
    return kept


def find(ids: list[int], part: list[int]) -> int | None:
    """Where `part` first starts in `ids`."""
    return next((i for i in range(len(ids) - len(part) + 1) if ids[i : i + len(part)] == part), None)


def close(tokenizer, sampled: list[int], tools: list[dict] | None) -> list[int]:
    """What the template ends an assistant turn with after its content, less what `sampled` already ends with."""
    closed = render_ids(tokenizer, STAND_IN, tools, False)
    content = tokenizer.encode(STAND_IN[1]["content"], add_special_tokens=False)
    at = next((i for i in range(len(closed) - len(content), -1, -1) if closed[i : i + len(content)] == content), None)
    if at is None:
        raise NotAppendOnly("the chat template does not render an assistant turn's content as its own tokens")
    ending = closed[at + len(content) :]
    done = next((k for k in range(len(ending), 0, -1) if sampled[-k:] == ending[:k]), 0)
    if (
        not done
        and len(ending) == 1
        and sampled
        and ends_turn(tokenizer, sampled[-1])
        and special(tokenizer, ending[0])
    ):
        return []  # the turn ended with another of the template's end tokens (Llama's <|eom_id|>, gpt-oss's <|call|>)
    return ending[done:]


# The tokens that end a model's turn (a turn that stops on one is closed): a turn cut short after another special
# token (Llama's <|python_tag|>, harmony's <|message|>) still gets the template's ending.
TURN_ENDS = frozenset(
    ("<|eot_id|>", "<|eom_id|>", "<|end|>", "<|call|>", "<|return|>", "<|im_end|>", "<|endoftext|>", "</s>")
    + ("<｜end▁of▁sentence｜>",)
)


def ends_turn(tokenizer, token: int) -> bool:
    """Whether `token` is a special token that ends a turn (TURN_ENDS, or the tokenizer's end of sequence)."""
    found = getattr(tokenizer, "added_tokens_decoder", {}).get(token)
    return bool(found and found.special and (found.content in TURN_ENDS or token == tokenizer.eos_token_id))


def special(tokenizer, token: int) -> bool:
    found = getattr(tokenizer, "added_tokens_decoder", {}).get(token)
    return bool(found and found.special)


def turn_context(
    tokenizer,
    held: list[int],
    after_sampled: bool,
    new: list[dict],
    tools: list[dict] | None,
    opens: bool,
    answered: list[dict] | None = None,
) -> list[list[int]]:
    """The context a turn appends, as [close, messages, prompt]: `opens` for a segment with no messages yet (every
    message rendered whole); `after_sampled` when `held` ends with a sampled assistant turn (its close goes first)."""
    if opens:
        first = opening(tokenizer, new, tools)
        return [[], first.messages, first.prompt]
    ending = close(tokenizer, held, tools) if after_sampled else []
    d = delta(tokenizer, new, tools, answered)
    return [ending, d.messages, d.prompt]


def turn(
    tokenizer,
    held_tail: list[int],
    after_sampled: bool,
    new: list[dict],
    tools: list[dict],
    opens: bool,
    forced: str,
    answered: list[dict] | None = None,
) -> list[list[int]]:
    """A session turn's context ids as [close, messages, prompt, forced] (`forced`: the text of a call tool_choice
    names, up to its arguments; `answered`: the tool calls of the turn the new messages follow). NotAppendOnly
    when the template has no exact continuation for these messages, or refuses them (a role it does not take: its
    own error's text)."""
    try:
        parts = turn_context(tokenizer, held_tail, after_sampled, for_template(new), tools, opens, answered)
    except NotAppendOnly:
        raise
    except Exception as e:  # the template's own error
        raise NotAppendOnly(str(e) or type(e).__name__) from e
    return [*parts, tokenizer.encode(forced, add_special_tokens=False) if forced else []]
