"""The control-plane state in a real redis-server (the session service's embedded one; two replicas that own the HTTP
front: the ingress replicas of the split front, the default, or a fused front's engine replicas): replays through
either of them, every one of them killed losing nothing of the queue, and Redis going away; on the bench app's two
ingress replicas, a DELETE through the other one."""

import asyncio
import time
import uuid

import httpx
import pytest
import ray

from rollout_farm.services.serving import server
from rollout_farm.services.state.embedded_redis import EmbeddedRedis
from tests.service.helpers import AUTH, any_busy, in_thread, replica_metric, wait_until

SHORT = {"max_new_tokens": 8, "temperature": 1.0}


def generated_tokens(service) -> float:
    return sum(replica_metric(service, "farm_replica_generated_tokens").values())


def front_actors(front: str) -> list:
    """The replicas that own the session app's HTTP front: the ingress deployment's with the split front, the engine
    deployment's with the fused one."""
    deployment = "ingress" if front == "split" else "engine"
    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::farm#{deployment}")
    ]


def ready_replicas(service) -> list:
    """The replicas /readyz reports ready; none while it is not ready or the front cuts the read."""
    try:
        r = httpx.get(f"{service}/readyz", timeout=30)
    except httpx.TransportError:
        return []
    return r.json()["replicas"] if r.status_code == 200 else []


def sources(service) -> dict:
    """The queue's sources; none while no front replica answers (Serve's proxy holds a request until one is back, and
    may give up first; HAProxy answers 500 or cuts it: each is a "not yet", for wait_until)."""
    try:
        r = httpx.get(f"{service}/v1/queue/sources", timeout=30)
    except httpx.TransportError:
        return {}
    return {s["name"]: s for s in r.json()} if r.status_code == 200 else {}


def test_a_request_id_replay_through_either_ingress_replica_returns_the_first_result(service):
    """Left to chance: which ingress replica answers each replay; they are sent until both have answered, up to 59
    (p of one replica answering every one, were the proxy to pick at random: 2**-58)."""
    body = {
        "prompts": [{"text": "Q: 3+4\nA:"}, {"text": "Q: 5+1\nA:"}],
        "n": 2,
        "sampling_params": {"max_new_tokens": 256, "temperature": 1.0, "ignore_eos": True},
        "request_id": "replayed-everywhere",
    }
    with httpx.Client(timeout=120) as http:
        first = http.post(f"{service}/v1/rollouts", json=body)
        assert first.status_code == 200, first.text
        tokens = generated_tokens(service)
        answered_by, replays = set(), []
        while len(answered_by) < 2 or len(replays) < 6:  # the proxy picks a replica at random: until both answered
            r = http.post(f"{service}/v1/rollouts", json=body)
            assert r.status_code == 200, r.text
            answered_by.add(r.headers["x-farm-ingress"])
            replays.append(r.json())
            assert len(replays) < 60, "one ingress replica answered every replay"
    assert all(r == first.json() for r in replays)
    assert generated_tokens(service) == tokens  # nothing generated again
    changed = {**body, "n": 3}
    r = httpx.post(f"{service}/v1/rollouts", json=changed, timeout=60)
    assert r.status_code == 409 and "request_id" in r.json()["error"]


def test_a_replay_on_the_other_ingress_replica_while_the_first_runs_gets_its_result(service):
    """Six concurrent callers, one request_id: whichever replicas they reach, the engines generate it once. Left to
    chance: which ingress replica each caller reaches; a round whose six all reach one replica (p = 1/32 were the
    proxy to pick at random) is run again under a new request_id, up to 5 rounds: p(fail) = 32**-5 < 1e-7."""
    rounds = 5

    async def call(http, body):  # like the client: a 429 (full queues: this session's engine queue holds 2) is retried
        for _ in range(20):
            r = await http.post(f"{service}/v1/rollouts", json=body)
            if r.status_code != 429:
                return r
            await asyncio.sleep(float(r.headers["retry-after"]))
        return r

    async def six(body):
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[call(http, body) for _ in range(6)])

    for _ in range(rounds):
        body = {
            "prompts": [{"text": "Q: 2+2\nA:"}],
            "n": 2,
            "sampling_params": {"max_new_tokens": 300, "temperature": 1.0, "ignore_eos": True},
            "request_id": f"concurrent-replay-{uuid.uuid4().hex}",
        }
        wait_until(lambda: not any_busy(service), "the replicas idle: a full engine queue would fail the rollout (429)")
        tokens = generated_tokens(service)
        answers = asyncio.run(six(body))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert all(a.json() == answers[0].json() for a in answers)
        assert generated_tokens(service) - tokens == 2 * 300  # one request's worth: 1 prompt x 2 samples x 300 tokens
        if len({a.headers["x-farm-ingress"] for a in answers}) == 2:
            return  # the replay reached the replica not running the request
    pytest.fail(
        f"in each of {rounds} rounds all six callers reached one ingress replica: the cross-replica replay never ran"
    )


def test_killing_every_front_replica_mid_run_loses_no_prompt_lease_ack_or_session(service, service_settings):
    prompts = [{"text": f"Q: {a}+{a + 1}\nA:", "ground_truth": str(2 * a + 1)} for a in range(12)]
    spec = {"name": "survivor", "prompts": prompts, "n": 2, "target_groups": 3, "sampling_params": SHORT}
    assert httpx.post(f"{service}/v1/queue/sources", json=spec, headers=AUTH, timeout=30).status_code == 200
    wait_until(lambda: sources(service)["survivor"]["ready"] >= 2, "groups ready")
    pulled = httpx.post(
        f"{service}/v1/queue/pull", json={"source": "survivor", "max_groups": 2, "lease_s": 3}, headers=AUTH
    ).json()["items"]
    assert len(pulled) == 2
    acked = {pulled[0]["item_id"]: pulled[0]["prompt"]["text"]}
    assert httpx.post(f"{service}/v1/queue/ack", json={"item_ids": [pulled[0]["item_id"]]}, headers=AUTH).json()[
        "acked"
    ] == [pulled[0]["item_id"]]  # the other stays leased, unacked, across the restart
    before = sources(service)["survivor"]
    session = httpx.post(f"{service}/v1/sessions", json={"sampling_params": SHORT}, timeout=30).json()["session_id"]
    first = httpx.post(f"{service}/v1/sessions/{session}/generate", json={"append_token_ids": [40, 41]}, timeout=60)
    assert first.status_code == 200, first.text

    killed = front_actors(service_settings.front)
    assert len(killed) == 2
    for actor in killed:
        ray.kill(actor, no_restart=True)
    back = wait_until(lambda: sources(service).get("survivor"), "the restarted ingress serves the queue", 180)
    wait_until(lambda: len(ready_replicas(service)) == service_settings.replicas, "every replica back", 180)
    assert back["acked"] == 1 and back["pending_prompts"] + back["ready"] + back["leased"] >= 1
    assert back["acked"] == before["acked"] and back["redelivered"] == before["redelivered"]
    r = httpx.post(f"{service}/v1/sessions/{session}/generate", json={"append_token_ids": [50]}, timeout=60)
    assert r.status_code == 200 and r.json()["turn"] == 1, r.text  # the session outlived every front replica
    assert r.json()["prompt_tokens"] == 2 + len(first.json()["token_ids"]) + 1

    deliveries = {pulled[1]["item_id"]: 1}
    deadline = time.monotonic() + 240
    while len(acked) < len(prompts):
        assert time.monotonic() < deadline, (len(acked), sources(service)["survivor"])
        r = httpx.post(
            f"{service}/v1/queue/pull", json={"source": "survivor", "max_groups": 4, "wait_s": 5}, headers=AUTH
        )
        assert r.status_code == 200, r.text
        items = [i for i in r.json()["items"] if i["item_id"] not in acked]  # a trainer skips an id it used
        for i in items:
            deliveries[i["item_id"]] = i["deliveries"]
        if items:
            ids = [i["item_id"] for i in items]
            assert httpx.post(f"{service}/v1/queue/ack", json={"item_ids": ids}, headers=AUTH).json()["acked"] == ids
            acked.update({i["item_id"]: i["prompt"]["text"] for i in items})
    assert sorted(acked.values()) == sorted(p["text"] for p in prompts)  # every prompt acked exactly once
    assert deliveries[pulled[1]["item_id"]] == 2  # the lease held across the restart ran out: delivered again
    final = sources(service)["survivor"]
    assert final["acked"] == 12 and final["pending_prompts"] == final["ready"] == final["leased"] == 0
    assert final["redelivered"] == 1
    httpx.delete(f"{service}/v1/queue/sources/survivor", headers=AUTH)


def test_redis_away_is_a_503_with_retry_after_and_nothing_is_lost(service, service_settings):
    prompts = [{"text": f"Q: {a}+2\nA:", "ground_truth": str(a + 2)} for a in range(5)]
    spec = {"name": "outage", "prompts": prompts, "n": 1, "target_groups": 2, "sampling_params": SHORT}
    assert httpx.post(f"{service}/v1/queue/sources", json=spec, headers=AUTH, timeout=30).status_code == 200
    wait_until(lambda: sources(service)["outage"]["ready"] == 2, "groups ready")
    before = sources(service)["outage"]
    embedded = next(e for e in server.EMBEDDED if str(e.folder) == service_settings.state_dir)
    embedded.stop()
    try:
        for method, path, body in [
            ("GET", "/v1/queue/sources", None),
            ("POST", "/v1/queue/pull", {"source": "outage"}),
            ("POST", "/v1/rollouts", {"prompts": [{"text": "Q: 1+1\nA:"}], "request_id": "during-outage"}),
            ("POST", "/v1/policy_stats", {"kl": 0.1}),
        ]:
            r = httpx.request(method, f"{service}{path}", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 503, (path, r.status_code, r.text)
            assert r.headers["retry-after"] == "2" and "Redis" in r.json()["error"], r.text
        plain = httpx.post(f"{service}/v1/rollouts", json={"prompts": [{"text": "Q: 1+1\nA:"}]}, timeout=60)
        assert plain.status_code == 200  # a rollout without a request_id needs no state
    finally:
        EmbeddedRedis(embedded.folder).start()  # the same folder and port: its append-only file
    after = wait_until(lambda: sources(service).get("outage"), "the queue answers again", 60)
    assert (after["acked"], after["pending_prompts"], after["ready"]) == (
        before["acked"],
        before["pending_prompts"],
        before["ready"],
    )
    items = httpx.post(
        f"{service}/v1/queue/pull", json={"source": "outage", "max_groups": 5, "wait_s": 60}, headers=AUTH, timeout=90
    ).json()["items"]
    assert items and all(i["deliveries"] == 1 for i in items)
    httpx.delete(f"{service}/v1/queue/sources/outage", headers=AUTH)


def test_a_delete_through_the_other_ingress_replica_cancels_the_rollout(bench_service):
    """The bench app (1 ms a token, two ingress replicas): DELETE reaches either replica; the one running the
    rollout cancels it at its next heartbeat. Left to chance: which replica each DELETE reaches (1/2 the one running
    the rollout) and, under a stall of the machine, a DELETE arriving after the rollout's 4 s of tokens (a trial that
    proves nothing, tried again); up to 24 trials: p(fail) = 2**-24 < 1e-7."""
    trials = 24
    for _ in range(trials):
        rid = f"cross-cancel-{uuid.uuid4().hex}"
        body = {
            "prompts": [{"token_ids": [40, 41, 42]}],
            "n": 2,
            "sampling_params": {"max_new_tokens": 4096, "temperature": 0, "ignore_eos": True},
            "request_id": rid,
        }
        t, out = in_thread(lambda: httpx.post(f"{bench_service}/v1/rollouts", json=body, timeout=300))
        wait_until(lambda: any_busy(bench_service), "the bench replica busy with the rollout")
        d = httpx.delete(f"{bench_service}/v1/rollouts/{rid}", headers=AUTH, timeout=30)
        assert d.status_code == 200, d.text
        t.join(60)
        r = out[0]
        wait_until(lambda: not any_busy(bench_service), "the bench replica idle again")
        if d.json()["cancelled"] is False and r.status_code == 200:
            assert all(len(s["token_ids"]) == 4096 for g in r.json()["groups"] for s in g["samples"]), r.text
            continue  # the DELETE came after the rollout's last token: too late to cancel it
        assert d.json()["cancelled"] is True, d.text
        assert r.status_code == 409 and "cancelled" in r.json()["error"], r.text  # well before its 4 s of tokens
        if d.headers["x-farm-ingress"] != r.headers["x-farm-ingress"]:
            return  # cancelled through the replica that was not running it
    pytest.fail(f"in {trials} trials no DELETE reached the replica not running the rollout in time to cancel it")
