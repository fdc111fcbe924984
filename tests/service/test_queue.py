"""The pull-mode trajectory queue against the real service: background generation, leases, acks, staleness."""

import json
import time

import httpx

from tests.conftest import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}


SHORT = {"max_new_tokens": 8, "temperature": 1.0}


def add_source(service, **spec):
    r = httpx.post(f"{service}/v1/queue/sources", json={"sampling_params": SHORT, **spec}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def pull(service, **req):
    r = httpx.post(f"{service}/v1/queue/pull", json={"wait_s": 60, **req}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def ack(service, ids):
    r = httpx.post(f"{service}/v1/queue/ack", json={"item_ids": ids}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def source_state(service, name):
    return next(s for s in httpx.get(f"{service}/v1/queue/sources", timeout=30).json() if s["name"] == name)


def wait_ready(service, name, ready):
    deadline = time.monotonic() + 120
    while source_state(service, name)["ready"] < ready:
        assert time.monotonic() < deadline, source_state(service, name)
        time.sleep(0.2)


def test_dataset_source_generates_ahead_and_acks_are_idempotent(service):
    add_source(service, name="arith-q", dataset="arith", n=3, target_groups=4)
    wait_ready(service, "arith-q", 4)  # generated in the background, before any pull
    got = pull(service, source="arith-q", max_groups=3)
    items = got["items"]
    assert len(items) == 3 and len({i["item_id"] for i in items}) == 3
    for item in items:
        assert len(item["group"]["samples"]) == 3 and item["deliveries"] == 1
        assert item["prompt"]["text"].startswith("Q: ") and item["prompt"]["ground_truth"]
        assert item["weight_version"] == min(s["weight_version"] for s in item["group"]["samples"])
        assert item["group"]["samples"][0]["sampler_meta"] == {"sampler": "plain"}
    state = source_state(service, "arith-q")
    assert state["leased"] == 3 and state["pending_prompts"] == 0 and state["dataset"] == "arith"
    ids = [i["item_id"] for i in items]
    first = ack(service, ids + ["arith-q:0", "nope:1"])
    assert first["acked"] == ids and first["unknown"] == ["arith-q:0", "nope:1"]
    again = ack(service, ids)  # a retried ack changes nothing
    assert again == {"acked": [], "already_acked": ids, "unknown": []}
    assert source_state(service, "arith-q")["leased"] == 0 and source_state(service, "arith-q")["acked"] == 3
    wait_ready(service, "arith-q", 4)  # a dataset source is endless: it refills to the target
    text = httpx.get(f"{service}/metrics").text
    assert (
        'farm_queue_acked_total{source="arith-q"} 3.0' in text and 'farm_queue_ready_groups{source="arith-q"}' in text
    )
    assert httpx.delete(f"{service}/v1/queue/sources/arith-q", headers=AUTH).status_code == 200
    assert httpx.post(f"{service}/v1/queue/pull", json={"source": "arith-q"}, headers=AUTH).status_code == 404
    add_source(service, name="arith-q", dataset="arith", n=1, target_groups=1)  # the same name again: new ids
    again = pull(service, source="arith-q", max_groups=1)["items"]
    assert (
        again and again[0]["item_id"] not in ids and ack(service, ids)["unknown"] == ids
    )  # old acks touch nothing new
    httpx.delete(f"{service}/v1/queue/sources/arith-q", headers=AUTH)


def test_expired_leases_are_redelivered_and_a_trainer_loses_and_repeats_nothing(service):
    prompts = [{"text": f"Q: {a}+{a}\nA:", "ground_truth": str(2 * a)} for a in range(10)]
    jsonl = "\n".join(json.dumps(p) for p in prompts).encode()
    add_source(service, name="pushed", n=2, target_groups=4)
    r = httpx.post(
        f"{service}/v1/queue/sources/pushed/prompts",
        content=jsonl,
        headers={**AUTH, "Content-Type": "application/x-ndjson"},
    )
    assert r.status_code == 200 and r.json()["pending_prompts"] + r.json()["ready"] <= 10

    lost = pull(service, source="pushed", max_groups=3, lease_s=0.5)["items"]  # a trainer that dies before it acks
    assert len(lost) == 3
    time.sleep(0.6)
    trained, deliveries = {}, {}  # item_id -> prompt text, for a trainer that drops ids it has seen
    while len(trained) < 10:
        got = pull(service, source="pushed", max_groups=4, lease_s=60)
        assert got["items"], source_state(service, "pushed")
        for item in got["items"]:
            deliveries[item["item_id"]] = item["deliveries"]
            assert item["item_id"] not in trained  # never delivered again once acked
            trained[item["item_id"]] = item["prompt"]["text"]
        assert not ack(service, [i["item_id"] for i in got["items"]])["unknown"]
    assert sorted(trained.values()) == sorted(
        p["text"] for p in prompts
    )  # every prompt once: nothing lost, no duplicate
    assert all(deliveries[i["item_id"]] == 2 for i in lost)  # the dead trainer's groups came back under their ids
    state = source_state(service, "pushed")
    assert (
        state["redelivered"] == 3
        and state["acked"] == 10
        and state["ready"] == state["leased"] == state["pending_prompts"] == 0
    )
    assert ack(service, list(trained))["already_acked"] == list(trained)
    assert 'farm_queue_redeliveries_total{source="pushed"} 3.0' in httpx.get(f"{service}/metrics").text
    httpx.delete(f"{service}/v1/queue/sources/pushed", headers=AUTH)  # no background generation left for later tests


def test_stale_groups_are_dropped_and_generated_again_on_new_weights(service, client, tiny_model):
    add_source(service, name="stale", prompts=[{"text": f"Q: {a}-1\nA:"} for a in range(4)], n=2, target_groups=4)
    wait_ready(service, "stale", 4)
    old = client.weights_version().version
    client.push_weights((tiny_model / "model.safetensors").read_bytes(), old + 1)
    got = pull(service, source="stale", max_groups=4, max_staleness=0)
    assert got["current_version"] == old + 1 and got["stale_dropped"] >= 1
    items = got["items"]
    while len(items) < 4:
        items += pull(service, source="stale", max_groups=4, max_staleness=0)["items"]
    assert all(i["weight_version"] == old + 1 for i in items)  # regenerated on the new weights
    assert sorted(i["prompt"]["text"] for i in items) == sorted(f"Q: {a}-1\nA:" for a in range(4))
    assert source_state(service, "stale")["stale_dropped"] == 4
    assert 'farm_queue_stale_dropped_total{source="stale"} 4.0' in httpx.get(f"{service}/metrics").text
    httpx.delete(f"{service}/v1/queue/sources/stale", headers=AUTH)


def test_queue_admin_needs_the_token_and_bad_input_is_named(service):
    spec = {"name": "guarded", "dataset": "arith"}
    assert httpx.post(f"{service}/v1/queue/sources", json=spec).status_code == 401
    bad = httpx.post(f"{service}/v1/queue/sources", json={**spec, "dataset": "mnist"}, headers=AUTH)
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "dataset"
    bad = httpx.post(f"{service}/v1/queue/sources", json={**spec, "reward": "nope"}, headers=AUTH)
    assert bad.status_code == 422 and "valid names" in bad.json()["detail"][0]["message"]
    add_source(service, name="guarded", target_groups=1)
    assert httpx.post(f"{service}/v1/queue/sources", json={"name": "guarded"}, headers=AUTH).status_code == 409
    upload = b'{"text": "fine"}\n{"txt": "typo"}\n'
    bad = httpx.post(
        f"{service}/v1/queue/sources/guarded/prompts",
        content=upload,
        headers={**AUTH, "Content-Type": "application/x-ndjson"},
    )
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"].startswith("line 2")
    assert source_state(service, "guarded")["pending_prompts"] == 0  # nothing of a bad upload is queued
    ok = httpx.post(f"{service}/v1/queue/sources/guarded/prompts", json={"prompts": [{"text": "fine"}]}, headers=AUTH)
    assert ok.status_code == 200
    assert httpx.post(f"{service}/v1/queue/pull", json={"source": "guarded"}).status_code == 401
    assert httpx.post(f"{service}/v1/queue/ack", json={"item_ids": ["guarded:x:0"]}).status_code == 401
    missing = httpx.post(f"{service}/v1/queue/pull", json={"source": "absent"}, headers=AUTH)
    assert missing.status_code == 404 and "guarded" in missing.json()["error"]
    assert (
        httpx.post(f"{service}/v1/queue/pull", json={"source": "guarded", "max_staleness": -1}, headers=AUTH).json()[
            "detail"
        ][0]["field"]
        == "max_staleness"
    )
    assert httpx.delete(f"{service}/v1/queue/sources/guarded").status_code == 401
    assert httpx.delete(f"{service}/v1/queue/sources/guarded", headers=AUTH).status_code == 200


def test_a_late_ack_of_a_stale_dropped_group_withdraws_its_regeneration(service, client, tiny_model):
    add_source(service, name="late", prompts=[{"text": "Q: 5+5\nA:"}, {"text": "Q: 6+6\nA:"}], n=2, target_groups=2)
    wait_ready(service, "late", 2)
    trained = pull(service, source="late", max_groups=2, lease_s=0.3)["items"]  # the trainer uses them, but acks late
    time.sleep(0.4)
    client.push_weights((tiny_model / "model.safetensors").read_bytes(), client.weights_version().version + 1)
    fresh = pull(service, source="late", max_groups=2, max_staleness=0, wait_s=0)
    assert fresh["stale_dropped"] == 2 and not fresh["items"]  # both dropped; their prompts wait to be generated again
    assert ack(service, [i["item_id"] for i in trained])["acked"] == [
        i["item_id"] for i in trained
    ]  # the late ack settles them
    state = source_state(service, "late")
    assert state["acked"] == 2 and state["leased"] + state["pending_prompts"] == 0
    assert not pull(service, source="late", max_groups=2, wait_s=2)["items"]  # nothing of those prompts comes again
    httpx.delete(f"{service}/v1/queue/sources/late", headers=AUTH)


def test_a_prompt_batch_with_a_batch_id_is_added_once(service, client):
    from rollout_farm.services import protocol as P

    client.queue_add_source(P.QueueSource(name="batched", target_groups=8, sampling_params=SHORT))
    prompts = [P.Prompt(text=f"Q: {a}+0\nA:") for a in range(3)]
    client.queue_add_prompts("batched", prompts, batch_id="run-1:1")
    client.queue_add_prompts("batched", prompts, batch_id="run-1:1")  # a retry, or a resumed trainer: nothing new
    client.queue_add_prompts("batched", prompts[:1], batch_id="run-1:2")
    items = []
    while len(items) < 4:
        got = client.queue_pull(P.PullRequest(source="batched", max_groups=8, wait_s=30)).items
        assert got, client.queue_sources()
        client.queue_ack([i.item_id for i in got])
        items += got
    assert not client.queue_pull(P.PullRequest(source="batched", max_groups=8, wait_s=3)).items
    assert sorted(i.prompt.text for i in items) == sorted([p.text for p in prompts] + [prompts[0].text])  # 3 + 1
    bad = httpx.post(
        f"{service}/v1/queue/sources/batched/prompts",
        params={"batch_id": "no spaces"},
        json={"prompts": [{"text": "x"}]},
        headers=AUTH,
    )
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"].endswith("batch_id")
    assert source_state(service, "batched")["acked"] == 4
    client.queue_remove_source("batched")


def test_a_tenants_episode_source_runs_its_episodes_in_its_own_sessions(service, http):
    """The sessions of the episodes a tenant's episode source runs are the tenant's: another tenant's token (or none)
    gets a 404 on them; the owner's and the admin's read them."""
    a, b = (
        {"Authorization": f"Bearer {http.post(f'/v1/tenants/{t}', headers=AUTH).json()['token']}"}
        for t in ("q-owner", "q-other")
    )
    spec = {"name": "owned-episodes", "prompts": [{"text": "Q: 1+1\nA:", "ground_truth": "2"}], "n": 1}
    spec |= {"target_groups": 1, "sampling_params": SHORT, "episodes": {"env": {"name": "calculator"}, "max_turns": 1}}
    assert http.post("/v1/queue/sources", json=spec, headers=a).status_code == 200
    pulled = http.post("/v1/queue/pull", json={"source": "owned-episodes", "wait_s": 60}, headers=a).json()["items"]
    sid = pulled[0]["group"]["samples"][0]["sampler_meta"]["session_id"]
    for who in (b, {}):
        assert http.get(f"/v1/sessions/{sid}/trajectory", headers=who).status_code == 404
    for who in (a, AUTH):
        assert http.get(f"/v1/sessions/{sid}/trajectory", headers=who).status_code == 200
    assert http.delete("/v1/queue/sources/owned-episodes", headers=a).status_code == 200
