"""A tenant's tokens_per_s is charged on every route that samples (docs/tenants.md, "Quotas and fair shares"):
streamed rollouts (as their lines go out), episodes (plain and streamed), session turns and Tinker's samples (which
are admitted too). Each test spends a tenant's one-second bucket of 1 token/s with one request, and its next request
is a 429 naming the tenant, with Retry-After; the negative control is a tenant without a quota, admitted again."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from tests.adapters import ADMIN

NAMES = itertools.count()
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
EPISODES = {
    "env": {"name": "calculator"},
    "prompts": [{"text": "Q: 1+1\nA:", "ground_truth": "2"}],
    "n": 1,
    "max_turns": 1,
    "sampling_params": GREEDY,
}


@pytest.fixture
def slow_and_free(http) -> tuple[str, dict, dict]:
    """A tenant held to 1 token/s (its name and headers) and one without a quota (headers); new names each test, so
    that no bucket carries over (the http fixture revokes them)."""
    i = next(NAMES)
    slow, free = f"slow-{i}-{time.time_ns() % 10**6}", f"free-{i}-{time.time_ns() % 10**6}"
    headers = [
        {"Authorization": f"Bearer {http.post(f'/v1/tenants/{t}', headers=ADMIN).json()['token']}"}
        for t in (slow, free)
    ]
    assert http.put(f"/v1/tenants/{slow}/quota", json={"tokens_per_s": 1}, headers=ADMIN).status_code == 200
    time.sleep(1.1)  # every ingress replica applies a quota within RECORDS_TTL_S (1 s)
    return slow, headers[0], headers[1]


def spent(answer, tenant: str) -> None:
    """The tenant's bucket is in debt: a 429 naming it, with the wait."""
    assert answer.status_code == 429, answer.text
    assert tenant in answer.json()["error"] and "tokens/s" in answer.json()["error"]
    assert int(answer.headers["retry-after"]) >= 1


def streamed(http, path: str, body: dict, headers: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line]


def test_a_streamed_rollout_charges_its_tokens(http, slow_and_free):
    tenant, slow, free = slow_and_free
    body = {"prompts": [{"token_ids": [40, 41, 42]}], "n": 2, "sampling_params": GREEDY}
    for who in (slow, free):
        lines = streamed(http, "/v1/rollouts", body, who)
        assert sum(len(s["token_ids"]) for x in lines[:-1] for s in x["group"]["samples"]) == 12
    spent(http.post("/v1/rollouts", json=body, headers=slow), tenant)
    assert http.post("/v1/rollouts", json=body, headers=free).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_episodes_charge_their_sampled_tokens(http, slow_and_free, stream):
    tenant, slow, free = slow_and_free
    for who in (slow, free):
        if stream:
            assert streamed(http, "/v1/episodes", EPISODES, who)[-1]["error"] is None
        else:
            assert http.post("/v1/episodes", json=EPISODES, headers=who).status_code == 200
    spent(http.post("/v1/episodes", json=EPISODES, headers=slow), tenant)
    assert http.post("/v1/episodes", json=EPISODES, headers=free).status_code == 200


TURNS = {
    "generate": {"append_token_ids": [40, 41]},
    "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6},
}


@pytest.mark.parametrize("route", sorted(TURNS))
def test_session_turns_charge_their_tokens(http, slow_and_free, route):
    tenant, slow, free = slow_and_free
    for who in (slow, free):
        sid = http.post("/v1/sessions", json={"sampling_params": GREEDY}, headers=who).json()["session_id"]
        first = http.post(f"/v1/sessions/{sid}/{route}", json=TURNS[route], headers=who)
        assert first.status_code == 200, first.text
        other = http.post("/v1/sessions", json={"sampling_params": GREEDY}, headers=who).json()["session_id"]
        again = http.post(f"/v1/sessions/{other}/{route}", json=TURNS[route], headers=who)
        if who is slow:
            spent(again, tenant)
        else:
            assert again.status_code == 200, again.text


def test_tinker_samples_are_admitted_and_charged(http, slow_and_free):
    tenant, slow, free = slow_and_free
    futures = {}
    for name, who in (("slow", slow), ("free", free)):
        key = {"X-API-Key": who["Authorization"].removeprefix("Bearer ")}
        session = http.post("/api/v1/create_session", json={}, headers=key).json()["session_id"]
        made = {"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-llama"}
        sampler = http.post("/api/v1/create_sampling_session", json=made, headers=key).json()["sampling_session_id"]
        sample = {
            "sampling_session_id": sampler,
            "seq_id": 0,
            "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [40, 41, 42]}]},
            "sampling_params": {"max_tokens": 6},
        }
        future = http.post("/api/v1/asample", json=sample, headers=key).json()["request_id"]
        for _ in range(20):  # held while it runs, then try_again
            done = http.post("/api/v1/retrieve_future", json={"request_id": future}, headers=key)
            if done.headers["content-type"] == "application/x-protobuf":
                break
        assert done.status_code == 200 and done.headers["content-type"] == "application/x-protobuf"
        futures[name] = (key, {**sample, "seq_id": 1})
    key, sample = futures["slow"]
    spent(http.post("/api/v1/asample", json=sample, headers=key), tenant)
    key, sample = futures["free"]
    assert http.post("/api/v1/asample", json=sample, headers=key).status_code == 200


def test_a_tenants_queue_source_is_charged_to_it(http, slow_and_free):
    """The source's background generation is admitted and charged as its owner's requests are: once its first group
    is ready, the owner's bucket is in debt (the tenant without a quota, the control, is admitted)."""
    from tests.service.helpers import wait_until

    tenant, slow, free = slow_and_free
    spec = {"name": f"q-{tenant}", "prompts": [{"token_ids": [40, 41, 42]}] * 2, "n": 2, "target_groups": 1}
    assert http.post("/v1/queue/sources", json={**spec, "sampling_params": GREEDY}, headers=slow).status_code == 200
    try:
        wait_until(lambda: http.get("/v1/queue/sources", headers=slow).json()[0]["ready"] >= 1, "a group ready")
        body = {"prompts": [{"token_ids": [40, 41, 42]}], "n": 1, "sampling_params": GREEDY}
        spent(http.post("/v1/rollouts", json=body, headers=slow), tenant)
        assert http.post("/v1/rollouts", json=body, headers=free).status_code == 200
    finally:
        assert http.delete(f"/v1/queue/sources/{spec['name']}", headers=slow).status_code == 200
