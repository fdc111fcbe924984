"""Whether a chat history a harness sends back repeats the one a session stored, and which known normalisations it
took to see so. Harnesses rarely echo a history byte for byte: they strip earlier thinking or move it to
`reasoning_content`, re-serialise a call's arguments, give their own ids to calls, re-order the results of parallel
calls, or merge them into one message. Each such rewrite is a named rule (RULES). A history that equals the stored one
once normalised by them is the same history: the turn appends to the stored tokens (only the new messages are
rendered; the stored tokens, reasoning included, stay as sampled). Any other difference is a rewrite: the session
forks with its parent (rollout_farm/services/episodes/segments.py). A rule accepts only an exact re-presentation of
the stored messages, never a near one: what it lets through must carry the same information.

  reasoning   an assistant turn without its reasoning, or with it as `reasoning_content` or as a leading <think>
              block of the content, wherever the stored turn has it (changed reasoning differs)
  arguments   a call's arguments as other JSON text of the same value (key order, spacing, unicode escapes)
  call_ids    calls under the harness's own ids, mapped one to one onto the stored ids (two calls may not share one)
  tool_order  the results of one turn's parallel calls in another order, matched by call id; each result unchanged
  tool_merge  one turn's results in one message: a tool message whose text parts are the results in order, or one
              whose text is them joined by a newline, or (Qwen's hermes templates) a tool or user message whose text
              is the `<tool_response>` blocks the template renders for them; only where that split is unique
  text_parts  a message's content as a list of text parts where the stored one is a string (or other parts)
`None` and "" content are the same at the wire already (protocol/sessions.py SessionMessage.as_chat).

The rules do not depend on the model family: each accepts only the stored messages themselves, so what it lets
through renders the same turn in any template. Families differ in which of them their harnesses need
(docs/episodes.md, "No false forks").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

THINK, THINK_END = "<think>", "</think>"  # the reasoning block of reasoning models (Qwen3, DeepSeek-R1, ...)
RULES = ("reasoning", "arguments", "call_ids", "tool_order", "tool_merge", "text_parts")
RESULT_OPEN, RESULT_CLOSE = "<tool_response>\n", "\n</tool_response>"  # how hermes templates render a tool result


def normal(message: dict) -> tuple:
    """What makes two chat messages the same turn: role, content (None as ""; an assistant's without its reasoning),
    the calls (arguments as parsed JSON), the tool call they answer, and a name."""
    calls = tuple(
        (c["function"]["name"], arguments(c["function"]["arguments"])) for c in message.get("tool_calls") or []
    )
    content = message.get("content") or ""
    if message["role"] == "assistant":
        content = reasoning_split(message)[1]
    return message["role"], content, calls, message.get("tool_call_id"), message.get("name")


def reasoning_split(message: dict) -> tuple[str, str]:
    """An assistant message's (reasoning, content): the reasoning as `reasoning_content`, or else a leading <think>
    block of its content (as reasoning models write it and their templates split it), each stripped of surrounding
    newlines. With `reasoning_content` given, the content is compared as sent: a think block in it as well is text the
    template renders (Qwen3's renders the content verbatim then), not reasoning to set aside."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or ""
    head, sep, rest = content.partition(THINK_END)
    if not reasoning and sep and head.lstrip().startswith(THINK):
        reasoning, content = head.lstrip().removeprefix(THINK), rest
    return reasoning.strip("\n"), content.lstrip("\n")


def same_turn(stored: dict, given: dict) -> bool:
    """Whether `given` is the stored message as a harness sends it back, call ids as they are (see `match` for
    histories)."""
    return turn_rules(stored, given, CallIds()) is not None


def arguments(text: str) -> str:
    """A call's arguments as compared: JSON text normalised (key order, spacing); text that is not JSON as it is.
    OpenAI's `arguments` is whatever the model wrote, which may not be JSON: such a call is kept as sent, and equals
    only the same text (the farm's own calls always read as JSON, so it never matches one of theirs)."""
    try:
        return json.dumps(json.loads(text or "{}"), sort_keys=True)
    except ValueError:
        return text


@dataclass(frozen=True)
class CallIds:
    """The harness's call ids for the stored ones, one to one: `given` -> stored and back."""

    to_stored: dict = field(default_factory=dict)
    to_given: dict = field(default_factory=dict)

    def bound(self, given_id: str, stored_id: str) -> CallIds | None:
        """These ids with given_id naming stored_id; None when either already names another."""
        if self.to_stored.get(given_id, stored_id) != stored_id or self.to_given.get(stored_id, given_id) != given_id:
            return None
        return CallIds({**self.to_stored, given_id: stored_id}, {**self.to_given, stored_id: given_id})

    def stored(self, given_id: str | None) -> str | None:
        """The stored id a given one names: its binding, else itself unless another given id took it."""
        if given_id in self.to_stored:
            return self.to_stored[given_id]
        return None if given_id in self.to_given else given_id


Step = tuple[frozenset, CallIds]  # the rules a step needed, and the call ids after it


def turn_rules(stored: dict, given: dict, ids: CallIds) -> Step | None:
    """Whether `given` is the stored message (None if not), the rules that needed, and the call ids its calls bind."""
    if stored["role"] != given["role"] or stored.get("name") != given.get("name"):
        return None
    rules = set()
    if "content_parts" in given and given["content_parts"] != parts(stored):  # the joined text compares below
        rules.add("text_parts")
    if stored["role"] == "assistant":
        (reasoning, content), (given_reasoning, given_content) = reasoning_split(stored), reasoning_split(given)
        if content != given_content or given_reasoning not in ("", reasoning):
            return None
        if any((stored.get(k) or "") != (given.get(k) or "") for k in ("content", "reasoning_content")):
            rules.add("reasoning")  # the reasoning left out, or moved to or from `reasoning_content`
    elif (stored.get("content") or "") != (given.get("content") or ""):
        return None
    stored_calls, given_calls = stored.get("tool_calls") or [], given.get("tool_calls") or []
    if len(stored_calls) != len(given_calls):
        return None
    for s, g in zip(stored_calls, given_calls):
        s_fn, g_fn = s["function"], g["function"]
        if s_fn["name"] != g_fn["name"] or arguments(s_fn["arguments"]) != arguments(g_fn["arguments"]):
            return None
        if s_fn["arguments"] != g_fn["arguments"]:
            rules.add("arguments")
        if g.get("id") is not None and (ids := ids.bound(g["id"], s.get("id"))) is None:
            return None
        if g.get("id") not in (None, s.get("id")):
            rules.add("call_ids")
    if stored.get("tool_call_id") != ids.stored(given.get("tool_call_id")):
        return None
    if stored.get("tool_call_id") != given.get("tool_call_id"):
        rules.add("call_ids")
    return frozenset(rules), ids


def parts(message: dict) -> list[str]:
    """A message's text parts as sent (SessionMessage.as_chat keeps them as `content_parts`), else its content."""
    return message.get("content_parts") or [message.get("content") or ""]


def results_run(stored: list[dict], i: int) -> int:
    """How many tool results start at stored[i] and answer the same assistant turn (0 unless the first of a run)."""
    if stored[i]["role"] != "tool" or (i and stored[i - 1]["role"] == "tool"):
        return 0
    k = 1
    while i + k < len(stored) and stored[i + k]["role"] == "tool":
        k += 1
    return k


def in_order(stored: list[dict], given: list[dict], ids: CallIds) -> Step | None:
    """Each given message the stored one at its place."""
    if len(given) != len(stored):
        return None
    rules = frozenset()
    for s, g in zip(stored, given):
        if (step := turn_rules(s, g, ids)) is None:
            return None
        rules, ids = rules | step[0], step[1]
    return rules, ids


def reordered(run: list[dict], given: list[dict], ids: CallIds) -> Step | None:
    """The run's results, each unchanged, in another order: matched by the call each answers."""
    by_id = {r.get("tool_call_id"): r for r in run}
    if len(given) != len(run) or None in by_id or len(by_id) != len(run) or any(g["role"] != "tool" for g in given):
        return None
    order = [by_id.get(ids.stored(g.get("tool_call_id"))) for g in given]
    if None in order or len({id(r) for r in order}) != len(run):
        return None
    step = in_order(order, given, ids)
    return (step[0] | {"tool_order"}, step[1]) if step else None


def merged(run: list[dict], given: dict, ids: CallIds) -> Step | None:
    """The run's results in one message, in order, split in one way only (see the module's docstring)."""
    results = [r.get("content") or "" for r in run]
    text = given.get("content") or ""
    if len(run) < 2 or any(r.get("content_parts") or r.get("name") != given.get("name") for r in run):
        return None
    if given["role"] == "tool":
        if ids.stored(given.get("tool_call_id")) not in {None, *(r.get("tool_call_id") for r in run)}:
            return None
        as_parts = given.get("content_parts") == results
        joined = text == "\n".join(results) and not any("\n" in r for r in results)
        if as_parts or joined or rendered_results(results) == text:
            return frozenset({"tool_merge"}), ids
    elif given["role"] == "user" and rendered_results(results) == text and "tool_call_id" not in given:
        return frozenset({"tool_merge"}), ids
    return None


def rendered_results(results: list[str]) -> str | None:
    """The results as hermes templates render consecutive tool messages in one user turn (Qwen2.5, Qwen3); None when
    a result holds the block's own tags (no unique split)."""
    if any(RESULT_OPEN.strip() in r or RESULT_CLOSE.strip() in r for r in results):
        return None
    return "\n".join(f"{RESULT_OPEN}{r}{RESULT_CLOSE}" for r in results)


def results_step(stored: list[dict], i: int, given: list[dict], j: int, ids: CallIds) -> tuple[int, int, Step] | None:
    """A whole run of results matched re-ordered or merged: (stored messages, given messages, step); None where the
    run is sent in order (matched a message at a time) or not at all."""
    k = results_run(stored, i)
    run = stored[i : i + k]
    if k < 2 or in_order(run, given[j : j + k], ids):
        return None
    if step := reordered(run, given[j : j + k], ids):
        return k, k, step
    # a merge is the run's last word: a tool message after it would answer the run's calls again (a merged result
    # followed by one of the results it holds is a rewrite, not a merge)
    after = given[j + 1]["role"] if j + 1 < len(given) else None
    if j < len(given) and after != "tool" and (step := merged(run, given[j], ids)):
        return k, 1, step
    return None


@dataclass(frozen=True)
class HistoryMatch:
    """How a given history repeats a stored one: the first `stored` stored messages are the first `given` given ones,
    once normalised by `rules`; `bounds` are the (stored, given) counts where a matched step ends (a merge or a
    re-order is one step), from (0, 0); `reshaped`: the stored messages a rule was needed for."""

    stored: int
    given: int
    rules: frozenset
    bounds: tuple[tuple[int, int], ...]
    reshaped: int


def match(stored: list[dict], given: list[dict]) -> HistoryMatch:
    """The longest prefix of `stored` that `given` repeats, message by message or a run of results at a time."""
    i = j = reshaped_ = 0
    rules, ids, bounds = frozenset(), CallIds(), [(0, 0)]
    while i < len(stored) and j < len(given):
        got = results_step(stored, i, given, j, ids)
        if got is None:
            step = turn_rules(stored[i], given[j], ids)
            got = (1, 1, step) if step else None
        if got is None:
            break
        di, dj, (used, ids) = got
        i, j, rules, reshaped_ = i + di, j + dj, rules | used, reshaped_ + (di if used else 0)
        bounds.append((i, j))
    return HistoryMatch(i, j, rules, tuple(bounds), reshaped_)


def shared_messages(stored: list[dict], given: list[dict]) -> int:
    """How many leading stored messages the given history repeats."""
    return match(stored, given).stored


def reshaped(stored: list[dict], given: list[dict]) -> int:
    """How many of the leading stored messages the given history repeats needed a normalisation."""
    return match(stored, given).reshaped
