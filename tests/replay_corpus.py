"""The replay corpus: seeded multi-turn episodes of a model family, stored as a session stores them, then sent back the
way harnesses send histories back. Each history is one harness rewrite of one episode, then the next message(s):
either a known normalisation (the session must APPEND: no false fork) or a genuine edit (it must FORK: the negative
control). Issue 39 item 4; the rules: rollout_farm/services/episodes/history_match.py.

No engine is needed to decide append or fork: the "engine" is a seeded choice of replies (reasoning, text, one call or
parallel calls in the family's tool format), written as a model samples them and stored through the family's real
chat template as a session stores them (tests/chat_families.py `episode`: the calls and reasoning read from the
sampled ids, the chat delta rendered between turns).

The families are tests/chat_families.py's FAMILIES (each its tokenizer with its real template, its tool format, how
its turns carry reasoning). `python -m tests.replay_corpus` runs the corpus for every family and writes
docs/data/replay_forks.json (per family, per case: histories, appends, forks); tests/unit/test_replay_corpus.py runs
a seeded part of the same corpus per family and asserts 0 false forks and 100% forks on the edits.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rollout_farm.services.episodes.history_match import match, reasoning_split
from rollout_farm.services.episodes.segments import Segment
from tests.chat_families import FAMILIES, Family, episode

TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"The {name}.", "parameters": {"type": "object"}}}
    for name in ("calculator", "search", "weather")
]
VALUES = ["37*48", "café au lait", "東京", 'naïve "quoted" text', 3, 12.5, True, None, [1, 2], {"deep": "é"}]
KEYS = ["expression", "query", "city", "limit", "unit", "filters"]
USERS = ["What is 37*48?", "And the weather there?", "Search for it, please.", "Thanks. One more?", "Why?"]
RESULTS = ["1776", "sunny, 21 °C", "no results", "line one\nline two", '{"hits": 3}', "4"]
THOUGHTS = ["Let me see.", "Two things to check.", "Easy."]
ANSWERS = ["The answer is 1776.", "It is sunny.", "Done.\nAnything else?"]


@dataclass(frozen=True)
class History:
    kind: str  # a normalisation (NORMALISATIONS) or an edit (EDITS)
    given: list[dict]  # what the harness sends: the rewritten history, then `new`
    new: list[dict]  # the messages the turn adds
    rules: frozenset  # the rules an append must count (normalisations)
    edited: int  # edits: the first stored message the edit changes (a fork keeps none from there)


def families() -> dict[str, Family]:
    """The families the corpus runs: every family of the tests."""
    return FAMILIES


def replies(rng: random.Random, family: Family) -> list[tuple[str, int]]:
    """An episode's turns as the model writes them, each with its number of calls: 4-6 turns, one of them calls
    (parallel where the family makes them), the last an answer."""
    kinds = ["parallel"] + [rng.choice(["call", "parallel", "answer"]) for _ in range(rng.randint(2, 4))]
    rng.shuffle(kinds)
    out = []
    for kind in kinds + ["answer"]:
        n = 0 if kind == "answer" else 1 if kind == "call" or not family.parallel else rng.randint(2, 3)
        calls = [call(rng) for _ in range(n)]
        text = rng.choice([rng.choice(ANSWERS)] if not n else ["", family.lead])
        out.append((written(family, rng.choice(THOUGHTS), text, calls), n))
    return out


def call(rng: random.Random) -> tuple[str, dict]:
    keys = rng.sample(KEYS, rng.randint(1, 3))
    return rng.choice(TOOLS)["function"]["name"], {k: rng.choice(VALUES) for k in keys}


def written(family: Family, thought: str, text: str, calls: list[tuple[str, dict]]) -> str:
    """A turn's text as the family's model writes it: its reasoning, its text, its calls."""
    said = text + (family.fmt.render_calls(calls) if calls else "")
    if family.reasoning == "think":
        return f"<think>\n{thought}\n</think>\n\n{said}"
    if family.reasoning == "opened":  # the prompt opened the <think> block
        return f"{thought}\n</think>\n\n{said}"
    if family.reasoning == "analysis":  # harmony: an analysis message, then the final answer or the call
        final = said if calls else f"<|channel|>final<|message|>{said}<|return|>"
        return f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant{final}"
    return said


def following(rng: random.Random, family: Family, turn: int, calls: int) -> list[dict]:
    """What comes after a sampled turn: a result per call (the format's call ids), or the user's next message."""
    if not calls:
        return [{"role": "user", "content": rng.choice(USERS)}]
    results = rng.sample(RESULTS, calls)  # distinct: results swapped between calls are another history
    return [{"role": "tool", "tool_call_id": family.fmt.call_id(turn, i), "content": r} for i, r in enumerate(results)]


def stored_episode(family: Family, seed: int) -> tuple[Segment, list[dict]]:
    """A session's segment after an episode's turns, and what follows its last turn."""
    rng = random.Random(seed)
    ask, turns = rng.choice(USERS), replies(rng, family)
    after = [following(rng, family, turn, n) for turn, (_, n) in enumerate(turns)]
    texts = [text for text, _ in turns]
    seg, _ = episode(family.tok, texts, after[:-1], family.fmt, family.tags, family.end, TOOLS, ask)
    return seg, after[-1]


def runs(history: list[dict]) -> list[tuple[int, int]]:
    """(start, length) of each run of two or more tool results (a turn's parallel calls answered)."""
    out, i = [], 0
    while i < len(history):
        k = 0
        while i + k < len(history) and history[i + k]["role"] == "tool":
            k += 1
        if k >= 2:
            out.append((i, k))
        i += max(k, 1)
    return out


def as_parts(text: str, rng: random.Random) -> dict:
    """Content as OpenAI text parts, as SessionMessage.as_chat passes them on."""
    cut = rng.randint(0, len(text))
    return {"content": text, "content_parts": [text[:cut], text[cut:]]}


# The normalisations: each a harness rewrite of the stored history that must append, and the rules it needs.
def strip_reasoning(h, rng):
    for m in h:
        if m["role"] == "assistant":
            m["content"] = reasoning_split(m)[1]
            m.pop("reasoning_content", None)
    return {"reasoning"}


def move_reasoning(h, rng):
    """A leading <think> block moved to `reasoning_content` (a turn whose reasoning is apart already is as stored)."""
    for m in h:
        if m["role"] == "assistant":
            m["reasoning_content"], m["content"] = reasoning_split(m)
    return {"reasoning"}


def reserialise_arguments(h, rng):
    for c in [c for m in h for c in m.get("tool_calls") or []]:
        value = json.loads(c["function"]["arguments"])
        if isinstance(value, dict) and rng.random() < 0.5:
            value = dict(reversed(value.items()))
        text = json.dumps(value, separators=rng.choice([(",", ":"), (", ", ": ")]), ensure_ascii=rng.random() < 0.5)
        c["function"]["arguments"] = text if text != c["function"]["arguments"] else json.dumps(value, indent=1)
    return {"arguments"}


def rename_call_ids(h, rng):
    names = {}
    for m in h:
        for c in m.get("tool_calls") or []:
            names[c["id"]] = c["id"] = f"toolu_{rng.getrandbits(48):012x}"
        if "tool_call_id" in m:
            m["tool_call_id"] = names.get(m["tool_call_id"], m["tool_call_id"])
    return {"call_ids"}


def reorder_results(h, rng):
    for start, k in runs(h):
        order = list(range(k))
        while order == sorted(order):
            rng.shuffle(order)
        h[start : start + k] = [h[start + o] for o in order]
    return {"tool_order"}


def merge_results(h, rng, shape=None):
    for start, k in reversed(runs(h)):
        results = [m["content"] for m in h[start : start + k]]
        form = shape or rng.choice(["parts", "rendered", "user", "joined"])
        if form == "joined" and any("\n" in r for r in results):
            form = "parts"  # a newline join splits one way only when no result holds one
        merged = {"role": "user"} if form == "user" else {"role": "tool", "tool_call_id": h[start]["tool_call_id"]}
        if form == "parts":
            merged |= {"content": "".join(results), "content_parts": results}
        elif form == "joined":
            merged["content"] = "\n".join(results)
        else:  # as hermes templates render the results in one user turn
            merged["content"] = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
        h[start : start + k] = [merged]
    return {"tool_merge"}


def text_parts(h, rng):
    for m in h:
        if m["role"] in ("user", "system"):
            m |= as_parts(m["content"], rng)
    return {"text_parts"}


def everything(h, rng):
    """All at once, as one harness may do: its own call ids, its own JSON, no thinking, results re-ordered in one
    turn and merged in another."""
    rules = rename_call_ids(h, rng) | reserialise_arguments(h, rng) | text_parts(h, rng)
    if any(reasoning_split(m)[0] for m in h if m["role"] == "assistant"):
        rules |= strip_reasoning(h, rng)
    if not runs(h):  # one call a turn: no results to merge or re-order
        return rules
    first, *rest = runs(h)
    if rest:  # merge the last runs, then re-order the first (its place is unchanged by a merge after it)
        for start, k in reversed(rest):
            sub = h[start : start + k]
            merge_results(sub, rng, "parts")
            h[start : start + k] = sub
        rules |= {"tool_merge"}
    start, k = first
    sub = h[start : start + k]
    h[start : start + k] = sub[::-1]
    return rules | {"tool_order"}


NORMALISATIONS = {
    "reasoning_stripped": strip_reasoning,
    "reasoning_moved": move_reasoning,
    "arguments_reserialised": reserialise_arguments,
    "call_ids_renamed": rename_call_ids,
    "results_reordered": reorder_results,
    "results_merged": merge_results,
    "text_parts": text_parts,
    "all_at_once": everything,
}
# The cases of parallel calls' results: none where a turn makes one call (harmony).
PARALLEL_ONLY = (
    "results_reordered",
    "results_merged",
    "result_ids_swapped",
    "merged_out_of_order",
    "merged_with_a_change",
    "call_id_shared",
)
# The cases a family's reasoning allows: none without reasoning; a move only where the content holds it (a <think>
# block; reasoning read apart, harmony's analysis channel or a block the prompt opened, is reasoning_content as
# stored).
APPLIES = {
    "reasoning_stripped": lambda f: f.reasoning is not None,
    "reasoning_moved": lambda f: f.reasoning == "think",
    "reasoning_edited": lambda f: f.reasoning is not None,
    **dict.fromkeys(PARALLEL_ONLY, lambda f: f.parallel),
}


# The edits: each a genuine rewrite that must fork; each returns the first stored message it changes.
def pick(h, rng, test) -> int:
    return rng.choice([i for i, m in enumerate(h) if test(i, m)])


def edit_user(h, rng):
    i = pick(h, rng, lambda i, m: m["role"] == "user")
    h[i]["content"] += " Or not."
    return i


def edit_result(h, rng):
    i = pick(h, rng, lambda i, m: m["role"] == "tool")
    h[i]["content"] = h[i]["content"] + "0"
    return i


def drop_message(h, rng):
    i = pick(h, rng, lambda i, m: i > 0)
    del h[i]
    return i


def edit_argument(h, rng):
    i = pick(h, rng, lambda i, m: m.get("tool_calls"))
    c = rng.choice(h[i]["tool_calls"])["function"]
    value = json.loads(c["arguments"])
    key = rng.choice(sorted(value))
    value[key] = [value[key], "edited"]
    c["arguments"] = json.dumps(value)
    return i


def edit_reasoning(h, rng):
    i = pick(h, rng, lambda i, m: m["role"] == "assistant")
    if h[i].get("reasoning_content"):
        h[i]["reasoning_content"] += " Or not."
    else:
        h[i]["content"] = h[i]["content"].replace("\n</think>", " Or not.\n</think>", 1)
    return i


def edit_answer(h, rng):
    i = pick(h, rng, lambda i, m: m["role"] == "assistant")
    h[i]["content"] += " Really."
    return i


def swap_turns(h, rng):
    """Two neighbours that are not results of one turn's parallel calls, swapped."""
    i = pick(h, rng, lambda i, m: i > 0 and i + 1 < len(h) and not (m["role"] == h[i + 1]["role"] == "tool"))
    h[i], h[i + 1] = h[i + 1], h[i]
    return i


def swap_result_ids(h, rng):
    """Two parallel results answering each other's call: each text now answers the wrong call."""
    start, k = rng.choice(runs(h))
    a, b = h[start]["tool_call_id"], h[start + 1]["tool_call_id"]
    h[start]["tool_call_id"], h[start + 1]["tool_call_id"] = b, a
    return start


def merge_out_of_order(h, rng):
    start, k = rng.choice(runs(h))
    results = [m["content"] for m in h[start : start + k]][::-1]
    h[start : start + k] = [{"role": "tool", "content": "".join(results), "content_parts": results}]
    return start


def merge_changed(h, rng):
    start, k = rng.choice(runs(h))
    results = [m["content"] for m in h[start : start + k]]
    results[rng.randrange(k)] += "!"
    h[start : start + k] = [{"role": "tool", "content": "".join(results), "content_parts": results}]
    return start


def share_call_id(h, rng):
    """Two calls of one turn under one id (no one-to-one map to the stored ids)."""
    i = pick(h, rng, lambda i, m: len(m.get("tool_calls") or []) >= 2)
    calls = h[i]["tool_calls"]
    old, calls[0]["id"] = calls[0]["id"], calls[1]["id"]
    for m in h[i + 1 :]:
        if m.get("tool_call_id") == old:
            m["tool_call_id"] = calls[1]["id"]
    return i


EDITS = {
    "user_text_edited": edit_user,
    "tool_result_edited": edit_result,
    "message_dropped": drop_message,
    "argument_value_edited": edit_argument,
    "reasoning_edited": edit_reasoning,
    "answer_edited": edit_answer,
    "turns_swapped": swap_turns,
    "result_ids_swapped": swap_result_ids,
    "merged_out_of_order": merge_out_of_order,
    "merged_with_a_change": merge_changed,
    "call_id_shared": share_call_id,
}


def histories(family: Family, seg: Segment, new: list[dict], seed: int) -> list[History]:
    """Every applicable rewrite of one stored episode, each followed by the same new messages."""
    out = []
    for kind, rewrite in NORMALISATIONS.items():
        if not APPLIES.get(kind, bool)(family):
            continue
        h = copy.deepcopy(seg.messages)
        rules = rewrite(h, random.Random(f"{seed}:{kind}"))
        out.append(History(kind, h + new, new, frozenset(rules), -1))
    for kind, rewrite in EDITS.items():
        if not APPLIES.get(kind, bool)(family):
            continue
        h = copy.deepcopy(seg.messages)
        edited = rewrite(h, random.Random(f"{seed}:{kind}"))
        out.append(History(kind, h + new, new, frozenset(), edited))
    return out


def decided(seg: Segment, history: History) -> tuple[bool, list[str]]:
    """(appended, what was wrong): an append must repeat the stored history under exactly the rules named, leave
    the new messages (only they are rendered), and find the last turn again on a retry; a fork must keep nothing from
    the edited message on, and repeat what it keeps."""
    m = match(seg.messages, history.given)
    appended = seg.extended_by(history.given)
    problems = []
    if appended:
        if m.rules != history.rules:
            problems.append(f"counted {sorted(m.rules)}, not {sorted(history.rules)}")
        if history.given[m.given :] != history.new:
            problems.append("the new messages are not what follows the match")
        retry = history.given[: m.given - 1]  # without the last turn's answer: that turn again
        if seg.answered(retry) is not seg.turns[-1]:
            problems.append("a retry of the last turn does not find it")
    else:
        fork = seg.fork("f", history.given)
        if history.edited >= 0 and len(fork.messages) > history.edited:
            problems.append(f"the fork keeps {len(fork.messages)} messages, past the edit at {history.edited}")
        if match(fork.messages, history.given).stored != len(fork.messages):
            problems.append("the fork's messages are not a prefix the history repeats")
    return appended, problems


def run(family: Family, episodes: int, seed: int = 0) -> dict:
    """The corpus for one family: per case, histories, appends, forks, and the first problems seen."""
    table: dict[str, Counter] = {}
    rules: dict[str, set] = {}
    problems: list[str] = []
    for e in range(episodes):
        seg, new = stored_episode(family, seed * 100_000 + e)
        for history in histories(family, seg, new, e):
            appended, wrong = decided(seg, history)
            row = table.setdefault(history.kind, Counter(histories=0, appends=0, forks=0))
            row["histories"] += 1
            row["appends" if appended else "forks"] += 1
            rules.setdefault(history.kind, set()).update(history.rules)
            problems += [f"{family.name} episode {e} {history.kind}: {w}" for w in wrong]
    return {
        "normalisations": {k: {**v, "rules": sorted(rules[k])} for k, v in table.items() if k in NORMALISATIONS},
        "edits": {k: dict(v) for k, v in table.items() if k in EDITS},
        "histories": sum(v["histories"] for v in table.values()),
        "problems": problems[:20],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=50, help="stored episodes per family (each rewritten ~18 ways)")
    parser.add_argument("--out", default="docs/data/replay_forks.json")
    args = parser.parse_args()
    out = {
        "command": f"python -m tests.replay_corpus --episodes {args.episodes}",
        "families": {name: run(f, args.episodes) for name, f in families().items()},
    }
    Path(args.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    for name, got in out["families"].items():
        false_forks = sum(v["forks"] for v in got["normalisations"].values())
        missed = sum(v["appends"] for v in got["edits"].values())
        print(f"{name}: {got['histories']} histories, {false_forks} false forks, {missed} edits appended")


if __name__ == "__main__":
    main()
