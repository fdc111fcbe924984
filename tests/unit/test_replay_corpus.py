"""No false forks (issue 39 item 4): the replay corpus (tests/replay_corpus.py) over every family of the tests
(tests/chat_families.py FAMILIES). Every normalisation a harness makes appends, with exactly the rules it needed
counted; every genuine edit forks (the negative control), keeping nothing from the edit on. No engine is needed: the
corpus's replies are seeded, written as a model samples them, and stored through the family's real template as a
session stores them.

The test runs the whole corpus, at least 500 histories per family (EPISODES; about 15 s in all), the same as the
committed measurement docs/data/replay_forks.json (`python -m tests.replay_corpus --episodes 42`), whose figures are
checked here too.
"""

import copy
import json
from pathlib import Path

import pytest

from rollout_farm.services.episodes.history_match import RULES, match
from rollout_farm.services.episodes.session_store import Session
from rollout_farm.services.episodes.sessions import Sessions
from rollout_farm.services.observability import metrics
from tests import replay_corpus as corpus

EPISODES = 42  # 12-19 histories an episode (by the family's reasoning and parallel calls): 504-798 a family
MEASURED = Path(__file__).parents[2] / "docs" / "data" / "replay_forks.json"


@pytest.fixture(scope="module")
def families():
    return corpus.families()


def applicable(family) -> tuple[set, set]:
    """The normalisations and edits the corpus makes for a family."""
    return (
        {k for k in corpus.NORMALISATIONS if corpus.APPLIES.get(k, bool)(family)},
        {k for k in corpus.EDITS if corpus.APPLIES.get(k, bool)(family)},
    )


@pytest.mark.parametrize("name", sorted(corpus.families()))
def test_no_false_forks_and_every_edit_forks(families, name):
    got = corpus.run(families[name], EPISODES)
    assert got["histories"] >= 500
    assert got["problems"] == []  # rules counted exactly, new messages after the match, retries, fork cuts
    normalised, edits = got["normalisations"], got["edits"]
    assert (set(normalised), set(edits)) == applicable(families[name])
    assert {k: v["forks"] for k, v in normalised.items()} == dict.fromkeys(normalised, 0)  # 0 false forks
    assert {k: v["appends"] for k, v in edits.items()} == dict.fromkeys(edits, 0)  # 100% forks on the edits


def test_the_committed_measurement_covers_every_family_with_500_histories_and_no_false_fork(families):
    measured = json.loads(MEASURED.read_text())
    assert measured["command"].startswith("python -m tests.replay_corpus")
    assert set(measured["families"]) == set(families)
    for name, got in measured["families"].items():
        assert got["histories"] >= 500 and got["problems"] == [], name
        assert (set(got["normalisations"]), set(got["edits"])) == applicable(families[name]), name
        assert all(v["forks"] == 0 for v in got["normalisations"].values()), name
        assert all(v["appends"] == 0 for v in got["edits"].values()), name


def test_every_normalisation_is_a_rewrite_a_literal_comparison_would_fork(families):
    """Negative control of the corpus itself: each normalised history differs from the stored one as sent, so it
    tests a rule, not an echo."""
    family = families["qwen3"]
    seg, new = corpus.stored_episode(family, 7)
    for history in corpus.histories(family, seg, new, 7):
        if history.rules:
            assert history.given[: len(seg.messages)] != seg.messages, history.kind


def test_the_metric_counts_each_rule_an_append_needed_and_a_fork_counts_none(families):
    family = families["qwen3"]
    seg, new = corpus.stored_episode(family, 3)
    cases = {h.kind: h for h in corpus.histories(family, seg, new, 3)}
    assert set(metrics.KNOWN_LABELS[metrics.SESSION_NORMALISED]) == set(RULES)
    sessions = Sessions(answer=None, renderer=None, store=None, model="m")

    def values() -> dict:
        counts = {r: metrics.SESSION_NORMALISED.labels(r)._value.get() for r in RULES}
        return counts | {"fork": metrics.SESSION_FORKS.labels("messages")._value.get()}

    def counted(history) -> dict:
        """What a turn with this history counts (chat_head: the segment it goes on in)."""
        session = Session("s", "hermes", {}, -1, 60.0, segments=[copy.deepcopy(seg)])
        before = values()
        sessions.chat_head(session, history.given)
        return {k: n - before[k] for k, n in values().items() if n - before[k] or k == "fork"}

    assert counted(cases["all_at_once"]) == {r: 1 for r in cases["all_at_once"].rules} | {"fork": 0}
    assert counted(cases["results_merged"]) == {"tool_merge": 1, "fork": 0}
    assert counted(cases["tool_result_edited"]) == {"fork": 1}


def test_a_merge_is_accepted_only_as_the_stored_results_in_order():
    """The tool_merge rule: the results as text parts, newline-joined (where that splits one way only), or as the
    hermes template's <tool_response> blocks; not out of order, not one short, not a join that splits two ways."""
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(2)]
    stored = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "a"},
        {"role": "tool", "tool_call_id": "c1", "content": "b"},
        {"role": "assistant", "content": "done"},
    ]

    def given(merged: dict) -> list[dict]:
        return stored[:2] + [merged] + stored[4:] + [{"role": "user", "content": "next"}]

    accepted = [
        {"role": "tool", "tool_call_id": "c0", "content": "ab", "content_parts": ["a", "b"]},
        {"role": "tool", "content": "a\nb"},
        {"role": "user", "content": "<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"},
    ]
    refused = [
        {"role": "tool", "tool_call_id": "c0", "content": "ba", "content_parts": ["b", "a"]},
        {"role": "tool", "tool_call_id": "c0", "content": "ab", "content_parts": ["ab"]},
        {"role": "tool", "tool_call_id": "c0", "content": "ab"},  # no parts: the boundary is unknown
        {"role": "tool", "tool_call_id": "c9", "content": "a\nb"},  # answers no call of the turn
        {"role": "user", "content": "a\nb"},
    ]
    for m in accepted:
        assert (match(stored, given(m)).stored, match(stored, given(m)).rules) == (5, {"tool_merge"}), m
    for m in refused:
        assert match(stored, given(m)).stored == 2, m
    two_ways = copy.deepcopy(stored)
    two_ways[2]["content"], two_ways[3]["content"] = "a\n", "b"  # "a\n\nb" also splits as "a", "\nb"
    assert match(two_ways, given({"role": "tool", "content": "a\n\nb"})).stored == 2
    # a merged result then one of its results again: a rewrite (it would store the second result twice), not a merge
    again = stored[:2] + [{"role": "tool", "tool_call_id": "c0", "content": "a\nb"}, stored[3]] + stored[4:]
    assert match(stored, again).stored == 2


def test_a_think_block_in_the_content_beside_reasoning_content_is_content():
    """Reasoning is set aside from `reasoning_content`, or else from a leading <think> block: with both, the block is
    text the template renders (Qwen3's renders the content verbatim then), so a changed one is another history."""
    stored = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Hello", "reasoning_content": "R"}]
    same = [stored[0], {"role": "assistant", "content": "<think>\nR\n</think>\n\nHello"}]  # the reasoning inline
    other = [stored[0], {"role": "assistant", "content": "<think>other</think>Hello", "reasoning_content": "R"}]
    assert match(stored, same).stored == 2 and match(stored, same).rules == {"reasoning"}
    assert match(stored, other).stored == 1


def test_call_ids_map_one_to_one():
    """A harness's own call ids are the stored ones when each names one stored call (its names, even one that is
    another stored call's); two calls under one id, or a result naming a stored id another given id took, are another
    history."""
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(2)]
    stored = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "a"},
        {"role": "tool", "tool_call_id": "c1", "content": "b"},
    ]

    def renamed(ids: list[str], answered: list[str]) -> list[dict]:
        out = copy.deepcopy(stored)
        for c, i in zip(out[1]["tool_calls"], ids):
            c["id"] = i
        for m, i in zip(out[2:], answered):
            m["tool_call_id"] = i
        return out

    assert match(stored, renamed(["x", "y"], ["x", "y"])).rules == {"call_ids"}
    assert match(stored, renamed(["x", "y"], ["y", "x"])).stored == 2  # results swapped between the calls
    assert match(stored, renamed(["x", "x"], ["x", "x"])).stored == 1  # two calls, one id
    assert match(stored, renamed(["x", "c0"], ["x", "c0"])).stored == 4  # ids are the harness's names: c0 -> c1
    assert match(stored, renamed(["x", "y"], ["x", "c1"])).stored == 3  # c1 was renamed y: not the stored result
