"""DELETE /v1/rollouts/{id}?partial=true: the rollout is cut at its next token and both the DELETE and the rollout's
own caller get what it generated, per-token versions included, for a trainer to recycle (slime's partial rollout)."""

import time
import uuid

import httpx

from tests.service.helpers import AUTH, LONG_TOKENS, any_busy, in_thread, rollout, wait_until


def seeded(max_new_tokens: int, n: int = 2) -> dict:
    return {
        "prompts": [{"token_ids": [50, 51, 52]}],
        "n": n,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, "seed": 3},
    }


def test_delete_with_partial_returns_what_was_generated_with_its_versions(service):
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    rid = f"recycle-{uuid.uuid4().hex}"
    t, out = in_thread(lambda: rollout(service, {**seeded(LONG_TOKENS), "request_id": rid}))
    wait_until(lambda: any_busy(service), "a replica decoding the rollout")
    time.sleep(0.3)
    r = httpx.delete(f"{service}/v1/rollouts/{rid}", params={"partial": "true"}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    cut = r.json()
    assert cut["cancelled"] is True and len(cut["groups"]) == 1
    samples = cut["groups"][0]["samples"]
    for s in samples:
        k = len(s["token_ids"])
        assert s["finish_reason"] == "abort" and 0 < k < LONG_TOKENS and len(s["logprobs"]) == k
        assert s["token_weight_versions"] == [s["weight_version"]] * k
    t.join(120)
    own = out[0].json()["groups"][0]["samples"]  # the rollout's caller got the same cut samples, not a 409
    assert out[0].status_code == 200 and [s["token_ids"] for s in own] == [s["token_ids"] for s in samples]
    # each cut sample is the prefix of the same seeded rollout run uncut
    whole = rollout(service, seeded(max(len(s["token_ids"]) for s in samples))).json()["groups"][0]["samples"]
    for s, w in zip(samples, whole):
        assert w["token_ids"][: len(s["token_ids"])] == s["token_ids"]
    gone = httpx.delete(f"{service}/v1/rollouts/{rid}", params={"partial": "true"}, headers=AUTH, timeout=30)
    assert gone.json() == {"request_id": rid, "cancelled": False}


def test_partial_must_be_a_boolean(service):
    r = httpx.delete(f"{service}/v1/rollouts/x", params={"partial": "maybe"}, headers=AUTH, timeout=30)
    assert r.status_code == 422 and "partial" in r.text
