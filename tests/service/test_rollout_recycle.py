"""DELETE /v1/rollouts/{id}?partial=true: the rollout is cut at its next token and both the DELETE and the rollout's
own caller get what it generated, per-token versions included, for a trainer to recycle (slime's partial rollout)."""

import uuid

import httpx
import pytest

from tests.service.helpers import AUTH, LONG_TOKENS, any_busy, in_thread, replicas, rollout, tokens, wait_until


def seeded(max_new_tokens: int, n: int = 2) -> dict:
    return {
        "prompts": [{"token_ids": [50, 51, 52]}],
        "n": n,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, "seed": 3},
    }


def decode_steps(service: str) -> int:
    return sum(s["decode_steps"] for s in replicas(service))


def test_delete_with_partial_returns_what_was_generated_with_its_versions(service):
    """Left to chance: the DELETE landing before the rollout's LONG_TOKENS tokens end (seconds after it is seen
    decoding); a trial where it came too late (a stall of the machine) proves nothing and is run again, up to 5."""
    for _ in range(5):
        wait_until(lambda: not any_busy(service), "replicas idle before the test")
        rid = f"recycle-{uuid.uuid4().hex}"
        steps = decode_steps(service)
        t, out = in_thread(lambda: rollout(service, {**seeded(LONG_TOKENS), "request_id": rid}))
        wait_until(lambda: decode_steps(service) >= steps + 5, "a replica decoding the rollout: some tokens")
        r = httpx.delete(f"{service}/v1/rollouts/{rid}", params={"partial": "true"}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        if r.json()["cancelled"]:
            break
        t.join(120)  # too late: the rollout ended with all its tokens
        assert [len(s) for s in tokens(out[0])] == [LONG_TOKENS] * 2, r.text
    else:
        pytest.fail("every DELETE came after the rollout's last token")
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
