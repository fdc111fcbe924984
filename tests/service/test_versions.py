"""Weight versions in flight: version routing, the in-flight policies, replicas that catch up, per-replica versions."""

from safetensors.torch import load_file, save

from rollout_farm.services import protocol as P
from rollout_farm.services.adapters.digest import base_digest, tensor_checksums
from tests.conftest import MIN_VERSION_WAIT_S, TOKEN
from tests.service.helpers import (
    LONG_TOKENS,
    any_busy,
    greedy,
    in_thread,
    long_rollout,
    perturbed,
    push,
    replace_an_engine_replica,
    replica_metric,
    replicas,
    rollout,
    versions,
    wait_until,
)


def test_rollout_waits_for_min_weight_version_until_it_is_pushed(service, tiny_model):
    current = versions(service)["version"]
    t, out = in_thread(
        lambda: rollout(service, {**greedy([[40, 41]], max_new_tokens=4), "min_weight_version": current + 1})
    )
    t.join(0.5)  # give it time to start waiting (the push below must land within FARM_MIN_VERSION_WAIT_S)
    assert push(service, (tiny_model / "model.safetensors").read_bytes(), current + 1).status_code == 200
    t.join(120)
    assert out and out[0].status_code == 200, out
    assert [s["weight_version"] for g in out[0].json()["groups"] for s in g["samples"]] == [current + 1]


def test_min_weight_version_never_pushed_gets_409_naming_the_field(service):
    current = versions(service)["version"]
    r = rollout(
        service,
        {**greedy([[40, 41]], max_new_tokens=4), "min_weight_version": current + 5},
        timeout=MIN_VERSION_WAIT_S + 120,
    )
    assert r.status_code == 409, r.text
    assert [d["field"] for d in r.json()["detail"]] == ["min_weight_version"] and str(current + 5) in r.json()["error"]
    assert versions(service)["version"] == current


# The rollout the in-flight policies are pushed into: the most tokens a sample may have, seconds of decoding. Left to
# chance: the push (its body made before the rollout starts) landing within them, a stall of the machine that long.
PUSH_TOKENS = 2 * LONG_TOKENS


def _push_during_long_rollout(service, tiny_model, policy: str) -> tuple[int, list[dict]]:
    """Start a long greedy rollout (one group: one replica), push a new version with `policy` while it decodes;
    the old version and the rollout's samples."""
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    old = versions(service)["version"]
    blob = save(perturbed(tiny_model, seed=3, scale=0.1))
    t, out = in_thread(lambda: rollout(service, long_rollout(n=2, max_new_tokens=PUSH_TOKENS)))
    wait_until(lambda: any_busy(service), "a replica busy with the rollout")
    r = push(service, blob, old + 1, policy=policy)
    assert r.status_code == 200 and r.json()["version"] == old + 1, r.text
    t.join(300)
    assert out and out[0].status_code == 200, out
    return old, [s for g in out[0].json()["groups"] for s in g["samples"]]


def test_policy_partial_switches_weights_mid_sample_and_names_each_tokens_policy(service, tiny_model, fresh_weights):
    old, samples = _push_during_long_rollout(service, tiny_model, "partial")
    assert old == fresh_weights
    assert all(
        s["weight_version"] == old and len(s["token_ids"]) == PUSH_TOKENS and s["finish_reason"] == "length"
        for s in samples
    )
    mixed = [s for s in samples if s["token_weight_versions"]]
    assert mixed, "no sample saw the commit"
    # what a trainer computes from what it pushed: the on-disk weights (old), then the perturbed ones
    digests = {
        old: base_digest(*tensor_checksums(load_file(tiny_model / "model.safetensors"))),
        old + 1: base_digest(*tensor_checksums(perturbed(tiny_model, seed=3, scale=0.1))),
    }
    for s in samples:
        v = s["token_weight_versions"]
        if not v:
            assert s["policies"] is None and s["policy"] == {**s["policy"], "base_version": old, "digest": digests[old]}
            continue
        assert len(v) == PUSH_TOKENS and v[0] == old and v[-1] == old + 1 and v == sorted(v)
        assert [(p["base_version"], p["digest"], p["adapter"]) for p in s["policies"]] == [
            (old, digests[old], None),
            (old + 1, digests[old + 1], None),
        ]
        assert s["policy"] == s["policies"][0]
        per_token = P.Sample.model_validate(s).token_policies()
        assert [(p.base_version, p.digest) for p in per_token] == [(x, digests[x]) for x in v]


def test_policy_abort_reruns_in_flight_samples_on_the_new_weights(service, tiny_model):
    old, samples = _push_during_long_rollout(service, tiny_model, "abort")
    for s in samples:
        assert (
            s["finish_reason"] == "length" and s["weight_version"] == old + 1 and len(s["token_ids"]) == PUSH_TOKENS
        ), {k: s[k] for k in ("finish_reason", "weight_version")}
        assert s["token_weight_versions"] is None


def test_policy_finish_lets_in_flight_samples_end_on_the_old_weights(service, tiny_model):
    old, samples = _push_during_long_rollout(service, tiny_model, "finish")
    for s in samples:
        assert s["weight_version"] == old and s["token_weight_versions"] is None and s["finish_reason"] == "length"
    assert set(versions(service)["replicas"].values()) == {old + 1}


def test_an_abort_push_reaches_replicas_whose_request_slots_are_full(service, tiny_model):
    """The fixture allows two ongoing requests per replica: four one-group rollouts fill both replicas. The push's
    stage and commit calls must still reach them, so every sample, the running ones included, ends on the new
    version. The push is sent once all four are at a replica (polled, not slept on). Left to chance: the push
    landing within the seconds their 2 * LONG_TOKENS tokens take, a stall of the machine that long."""
    from rollout_farm.services import protocol as P
    from rollout_farm.services.client import FarmClient

    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    old = versions(service)["version"]
    blob = save(perturbed(tiny_model, seed=4, scale=0.1))
    with FarmClient(
        service, TOKEN, retries=100, backoff_s=0.05, max_backoff_s=0.5
    ) as c:  # retries the 429s of a full engine queue
        # long enough that the running ones are still running when the push lands, on an idle machine too
        runs = [
            in_thread(
                lambda i=i: c.rollouts(
                    P.RolloutRequest.model_validate(greedy([[40 + i, 41]], 2 * LONG_TOKENS, ignore_eos=True))
                )
            )
            for i in range(4)
        ]
        wait_until(  # every rollout at a replica, both replicas decoding
            lambda: (
                all(x["busy"] for x in replicas(service))
                and sum(x["rollouts_running"] + x["rollouts_waiting"] for x in replicas(service)) == 4
            ),
            "the four rollouts in the replicas' slots",
        )
        r = push(service, blob, old + 1, policy="abort")
        assert r.status_code == 200, r.text
        for t, _ in runs:
            t.join(300)
    got = [(s.weight_version, s.finish_reason) for _, out in runs for g in out[0].groups for s in g.samples]
    assert got == [(old + 1, "length")] * 4, got


def test_each_replica_reports_its_version_over_http_and_in_metrics(service, tiny_model):
    version = versions(service)["version"] + 1
    assert push(service, (tiny_model / "model.safetensors").read_bytes(), version).status_code == 200
    now = versions(service)
    assert now["version"] == version and len(now["replicas"]) == 2 and set(now["replicas"].values()) == {version}
    assert replica_metric(service, "farm_replica_weight_version") == {rid: float(version) for rid in now["replicas"]}
    assert {s["replica"] for s in replicas(service)} == set(now["replicas"])


def test_restarted_replica_catches_up_before_serving(client, fresh_weights, tiny_model):
    """Kill an engine replica; Serve starts a new one, which loads the committed version before taking traffic."""

    state = load_file(tiny_model / "model.safetensors")
    client.push_weights(save({k: v * 1.01 for k, v in state.items()}), fresh_weights + 1)
    now = replace_an_engine_replica(client, timeout_s=120)
    assert set(now.values()) == {fresh_weights + 1}  # the new replica serves the committed version, not version 0
