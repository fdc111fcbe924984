"""No false forks over HTTP (issue 39 item 4): a harness that sends the history back in its own form (its call ids,
its JSON, parallel results merged as text parts) appends to the session's tokens and counts each rule in
farm_session_normalised_appends_total{rule}; an edited result forks. The model is the bench app's scripted EchoEngine
(tests/service/test_session_chat.py says why); the corpus of such rewrites: tests/unit/test_replay_corpus.py.
"""

import json

from tests.service.helpers import metric
from tests.service.test_session_chat import CALC, call_text, chat, opened, trajectory

RULES = ("tool_merge", "call_ids", "arguments")


def counts(bench: str) -> dict:
    out = {rule: metric(bench, "farm_session_normalised_appends_total", rule=rule) for rule in RULES}
    return out | {"fork": metric(bench, "farm_session_forks_total", reason="messages")}


def test_a_harness_that_renames_calls_and_merges_parallel_results_appends_an_edit_forks(bench_service):
    sid = opened(bench_service)["session_id"]
    history = [{"role": "user", "content": f"Two sums. say:‹{call_text('12*31')}{call_text('2+2')}›"}]
    first = {"messages": history, "tools": [CALC], "max_tokens": 200}  # two calls: 124 bytes, a token a byte
    calls = chat(bench_service, sid, first).json()["choices"][0]["message"]
    assert [json.loads(c["function"]["arguments"]) for c in calls["tool_calls"]] == [
        {"expression": "12*31"},
        {"expression": "2+2"},
    ]
    results = [
        {"role": "tool", "tool_call_id": calls["tool_calls"][0]["id"], "content": "372"},
        {"role": "tool", "tool_call_id": calls["tool_calls"][1]["id"], "content": "4 say:‹372 and 4.›"},
    ]
    history += [calls, *results]
    answer = chat(bench_service, sid, {"messages": history, "tools": [CALC]}).json()["choices"][0]["message"]
    assert answer["content"] == "372 and 4."

    renamed = {**calls, "tool_calls": []}  # the harness's own ids and JSON for the calls
    for k, c in enumerate(calls["tool_calls"]):
        arguments = json.dumps(json.loads(c["function"]["arguments"]), indent=2)
        renamed["tool_calls"].append({**c, "id": f"toolu_{k}", "function": {**c["function"], "arguments": arguments}})
    merged = {
        "role": "tool",
        "tool_call_id": "toolu_0",
        "content": [{"type": "text", "text": r["content"]} for r in results],
    }
    before = counts(bench_service)
    sent = [history[0], renamed, merged, answer, {"role": "user", "content": "Thanks. say:‹Bye.›"}]
    r = chat(bench_service, sid, {"messages": sent, "tools": [CALC]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Bye.", r.text
    assert {k: v - before[k] for k, v in counts(bench_service).items()} == {**dict.fromkeys(RULES, 1), "fork": 0}
    (segment,) = trajectory(bench_service, sid)["segments"]  # appended: one segment, the three sampled turns
    said = [call_text("12*31") + call_text("2+2"), "372 and 4.", "Bye."]
    assert sum(segment["loss_mask"]) == sum(len(t.encode()) for t in said)

    edited = [history[0], renamed, {**merged, "content": [{"type": "text", "text": "371"}, merged["content"][1]]}]
    r = chat(bench_service, sid, {"messages": [*edited, answer, {"role": "user", "content": "Sure? say:‹Yes.›"}]})
    assert r.status_code == 200, r.text
    assert counts(bench_service)["fork"] - before["fork"] == 1
    parent, fork = trajectory(bench_service, sid)["segments"]
    assert fork["parent_tokens"] == parent["turns"][0]["end"]  # cut after the calls: the edited results go on anew
