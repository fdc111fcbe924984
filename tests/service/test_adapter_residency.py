"""A replica's adapter residency within FARM_ADAPTER_BYTES_PER_REPLICA, on the real service (one engine replica, real
Redis, real HTTP): loading one version too many unloads the least recently used one that no request uses; a request
for it loads it again from Redis, its digest checked, and gets exactly that policy (the same digest and logprobs as
before); a version a running request uses is never unloaded, and a request that finds no room is a 429 naming the
setting, never another policy. An adapter larger than the budget is refused at its push."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.adapters import ADMIN, push, rollout
from tests.service.helpers import in_thread, replica_metric, replicas, second_app, wait_until

SETTING = "FARM_ADAPTER_BYTES_PER_REPLICA"


def size_of(folder) -> int:
    """Bytes an adapter holds on a float32 replica."""
    return sum(t.numel() * 4 for t in load_file(folder / "adapter_model.safetensors").values())


@pytest.fixture(scope="module")
def lru_url(service, tiny_model, folders, tmp_path_factory):
    """The app under /lru: one engine replica with room for two of the test adapters (all of one size)."""
    sizes = {size_of(f) for f in folders.values()}
    assert len(sizes) == 1
    with second_app(
        service,
        "lru",
        model=str(tiny_model),
        replicas=1,
        ingress_replicas=1,
        engine_max_ongoing_requests=4,
        engine_max_queued_requests=4,
        adapter_bytes_per_replica=2 * sizes.pop(),
        state_dir=str(tmp_path_factory.mktemp("lru-state")),
    ) as url:
        yield url


@pytest.fixture(scope="module")
def lru(lru_url):
    """An HTTP client on /lru; every adapter retired afterwards."""
    with httpx.Client(base_url=lru_url, timeout=120) as c:
        yield c
        for a in c.get("/v1/adapters", headers=ADMIN).json()["adapters"]:
            c.delete(f"/v1/adapters/{a['name']}", headers=ADMIN)


def loaded(http) -> set[str]:
    """The adapter versions the replica holds loaded now."""
    out = set()
    for a in http.get("/v1/adapters", headers=ADMIN).json()["adapters"]:
        info = http.get(f"/v1/adapters/{a['name']}", headers=ADMIN).json()
        out |= {f"{a['name']}@v{v}" for vs in info["resident"].values() for v in vs}
    return out


def drawn(answer) -> tuple[set, list, list]:
    """(the digests its samples carry, their tokens, their logprobs)."""
    assert answer.status_code == 200, answer.text
    samples = [s for g in answer.json()["groups"] for s in g["samples"]]
    return {s["policy"]["digest"] for s in samples}, [s["token_ids"] for s in samples], [s["logprobs"] for s in samples]


def same_policy(a, b) -> bool:
    """The same digest and tokens, and logprobs equal up to float32 rounding (a prompt's KV cache, kept for the same
    policy, may be reused by the second rollout and summed in another order)."""
    return a[:2] == b[:2] and torch.allclose(torch.tensor(a[2]), torch.tensor(b[2]), atol=1e-5, rtol=0)


def test_the_least_recently_used_version_is_unloaded_and_loaded_again_on_demand_as_the_same_policy(
    lru, lru_url, folders
):
    digests = {}
    for name, seed in (("alpha", 1), ("beta", 2)):
        pushed = push(lru, name, 1, folders[seed])
        assert pushed.status_code == 200, pushed.text
        digests[name] = pushed.json()["digest"]
    before = {name: drawn(rollout(lru, {"name": name, "version": 1})) for name in ("beta", "alpha")}  # alpha newest
    assert before["alpha"][0] == {digests["alpha"]} and before["beta"][0] == {digests["beta"]}
    assert loaded(lru) == {"alpha@v1", "beta@v1"}
    (evictions,) = replica_metric(lru_url, "farm_replica_adapter_evictions").values()

    gamma = push(lru, "gamma", 1, folders[3])  # no room for a third: beta, the least recently used, goes
    assert gamma.status_code == 200, gamma.text
    assert loaded(lru) == {"alpha@v1", "gamma@v1"}
    again = drawn(rollout(lru, {"name": "beta", "version": 1}))  # loaded again from Redis: alpha goes now
    assert same_policy(again, before["beta"])  # the same digest, tokens and logprobs: exactly that policy
    assert loaded(lru) == {"beta@v1", "gamma@v1"}
    assert same_policy(drawn(rollout(lru, {"name": "alpha", "version": 1})), before["alpha"])
    assert loaded(lru) == {"alpha@v1", "beta@v1"}

    (size,) = replica_metric(lru_url, "farm_replica_adapter_bytes").values()
    assert size == 2 * size_of(folders[1])
    assert replica_metric(lru_url, "farm_replica_adapter_evictions").popitem()[1] == evictions + 3
    (state,) = replicas(lru_url)
    assert state["adapter_bytes"] == size


def test_a_version_in_use_is_never_unloaded_and_no_room_is_a_429_naming_the_setting(lru, lru_url, folders):
    for name, seed in (("delta", 1), ("epsilon", 2), ("zeta", 3)):
        assert push(lru, name, 1, folders[seed]).status_code == 200
    body = {"prompts": [{"token_ids": [40, 41, 42]}], "n": 1}
    long = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
    running = [
        in_thread(
            lambda name=name: lru.post(
                "/v1/rollouts", json={**body, "adapter": {"name": name, "version": 1}, "sampling_params": long}
            )
        )
        for name in ("delta", "epsilon")
    ]
    wait_until(lambda: replicas(lru_url)[0]["rollouts_running"] == 2, "both long rollouts running")
    wait_until(lambda: replicas(lru_url)[0]["busy"], "the replica decoding them")
    refused = lru.post(
        "/v1/rollouts",
        json={
            **body,
            "adapter": {"name": "zeta", "version": 1},
            "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        },
    )
    assert refused.status_code == 429, refused.text
    assert SETTING in refused.json()["error"] and refused.headers.get("retry-after")
    assert loaded(lru) == {"delta@v1", "epsilon@v1"}  # both in use: neither was unloaded
    for t, out in running:
        t.join(300)
        assert out and out[0].status_code == 200, out
        assert {s["policy"]["adapter"] for g in out[0].json()["groups"] for s in g["samples"]} <= {"delta", "epsilon"}
    served = rollout(lru, {"name": "zeta", "version": 1})  # once they end, there is room
    assert served.status_code == 200 and {s["policy"]["adapter"] for s in served.json()["groups"][0]["samples"]} == {
        "zeta"
    }


def test_an_adapter_larger_than_the_budget_is_refused_at_its_push(lru, tiny_model, tmp_path):
    from tests.adapters import peft_adapter

    big = peft_adapter(tiny_model, tmp_path / "big", seed=7, r=16)
    refused = push(lru, "big", 1, big)
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"][0]["field"] == "adapter_model" and SETTING in refused.text
    assert "big@v1" not in loaded(lru)
    assert rollout(lru, {"name": "big", "version": 1}).status_code in (404, 409)  # nothing was recorded
