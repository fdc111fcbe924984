"""A session sticks to one engine replica, whose KV cache saves the prefill of its earlier turns; when that replica
dies, the session's next turn prefills once on the other replica and sticks there. Read from each replica's own
counters on /metrics (farm_replica_prefill_tokens, farm_replica_session_cache_tokens), never from timings. At the end
both replicas serve again, for the tests after this one."""

import time

import httpx
import ray

from tests.metrics_text import by_label
from tests.service.helpers import resent, wait_until

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def counters(service: str) -> dict[str, tuple[float, float]]:
    """replica id -> (prefill tokens, session cache tokens)."""
    text = resent(lambda: httpx.get(f"{service}/metrics", timeout=60), "/metrics").text
    fed = by_label(text, "farm_replica_prefill_tokens", "replica")
    saved = by_label(text, "farm_replica_session_cache_tokens", "replica")
    return {r: (fed[r], saved.get(r, 0.0)) for r in fed}


def turn(service: str, sid: str, ids: list[int]) -> dict:
    r = httpx.post(f"{service}/v1/sessions/{sid}/generate", json={"append_token_ids": ids}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def moved(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    return {r: (after[r][0] - before[r][0], after[r][1] - before[r][1]) for r in after if r in before}


def two_replicas(service: str) -> dict | None:
    now = counters(service)
    return now if len(now) == 2 else None


def test_a_session_sticks_to_its_replica_and_survives_losing_it(service):
    start = wait_until(lambda: two_replicas(service), "both replicas ready")
    sid = httpx.post(f"{service}/v1/sessions", json={"sampling_params": GREEDY}, timeout=30).json()["session_id"]
    new = [[40, 41, 42, 43, 44, 45, 46, 47], [50, 51, 52], [60, 61], [70, 71, 72, 73]]
    held = 0
    for k, ids in enumerate(new[:3]):
        before = counters(service)
        answer = turn(service, sid, ids)
        delta = moved(before, counters(service))
        (home,) = [r for r, (fed, _) in delta.items() if fed > 0]  # one replica ran the turn
        if k:
            assert home == first_home  # noqa: F821 (set on turn 0): sticky
            assert delta[home] == (len(ids) + 1, held - 1)  # only the new ids and the last sampled token
        first_home = home
        held += len(ids) + len(answer["token_ids"])
    assert first_home in start

    victim = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(f"#{first_home}")]
    assert len(victim) == 1, victim
    ray.kill(ray.get_actor(victim[0]["name"], namespace=victim[0]["namespace"]), no_restart=True)
    (survivor,) = [r for r in start if r != first_home]
    deadline = time.monotonic() + 120
    while True:  # the turn after the loss: on the survivor, a whole prefill
        before = counters(service)
        r = resent(
            lambda: httpx.post(f"{service}/v1/sessions/{sid}/generate", json={"append_token_ids": new[3]}, timeout=120),
            "the turn after the loss",
        )
        if r.status_code == 200:
            break
        assert r.status_code == 503 and "Retry-After" in r.headers, r.text  # the dead replica's call: retry
        assert time.monotonic() < deadline, r.text
        time.sleep(1)
    delta = moved(before, counters(service))
    assert delta[survivor] == (held + len(new[3]), 0)  # re-prefilled once, from the tokens kept in Redis
    held += len(new[3]) + len(r.json()["token_ids"])
    before = counters(service)
    turn(service, sid, [80])
    delta = moved(before, counters(service))
    assert delta[survivor] == (2, held - 1)  # and sticks to the survivor from then on
    wait_until(lambda: two_replicas(service) and first_home not in counters(service), "a replacement replica", 180)
