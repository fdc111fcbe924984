"""Concurrent requests share the engine's batches, and get 429 only past the configured queue, through HTTP on an app
of its own: one replica of the tiny model with FARM_ENGINE_MAX_ONGOING_REQUESTS=8 and
FARM_ENGINE_MAX_QUEUED_REQUESTS=4, behind one ingress replica (every request reaches that replica the same way).

Requests are held by pausing the replica: they take their slots (running: their engine calls wait in the engine's
queue) or wait for one, as /metrics shows; on resume the engine admits the waiting calls together. That they shared
decode steps is read from the replica's counters (ReplicaState.batch_calls, farm_engine_batch_calls), never from
timings."""

import asyncio

import httpx
import pytest

from rollout_farm.services.errors import QUEUES_FULL
from tests.metrics_text import by_label, scrape
from tests.service.helpers import (
    AUTH,
    LONG_TOKENS,
    any_busy,
    in_thread,
    replica_metric,
    replicas,
    second_app,
    wait_until,
)

ONGOING, QUEUED = 8, 4


@pytest.fixture(scope="module")
def conc(service, tiny_model, tmp_path_factory):
    """The app under /conc, in the session's Serve instance."""
    with second_app(
        service,
        "conc",
        model=str(tiny_model),
        replicas=1,
        ingress_replicas=1,
        engine_max_ongoing_requests=ONGOING,
        engine_max_queued_requests=QUEUED,
        state_dir=str(tmp_path_factory.mktemp("conc-state")),
    ) as url:
        yield url


def one_sample(i: int, max_new_tokens: int = 16) -> dict:
    return {
        "prompts": [{"token_ids": [40 + i % 20, 41, 42]}],
        "n": 1,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }


def rollouts(url: str) -> tuple[float, float]:
    """(running, waiting) rollouts of the one replica, from /metrics (it answers while the replica is paused)."""
    running = replica_metric(url, "farm_replica_rollouts_running")
    waiting = replica_metric(url, "farm_replica_rollouts_waiting")
    return sum(running.values()), sum(waiting.values())


def overload_count(url: str) -> float:
    return by_label(scrape(url), "farm_overload_rejections_total", "kind").get("replica_full", 0.0)


def batch_calls_buckets(url: str) -> dict[str, float]:
    """le -> cumulative decode steps of the one replica's farm_engine_batch_calls histogram."""
    return by_label(scrape(url), "farm_engine_batch_calls_bucket", "le")


async def post_all(url: str, path: str, bodies: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        return await asyncio.gather(*[http.post(f"{url}{path}", json=b) for b in bodies])


def test_requests_within_the_limits_share_batches_and_the_next_one_gets_429(conc):
    """ONGOING + QUEUED one-sample requests at once are all answered 200 (none refused below the configured limits);
    held while paused, ONGOING of them run and QUEUED wait, and one more is refused with 429 and Retry-After. On
    resume the ONGOING engine calls are admitted together: one decode step serves all of them."""
    rejected_before = overload_count(conc)
    assert httpx.post(f"{conc}/v1/pause", headers=AUTH, timeout=30).status_code == 200
    t, out = in_thread(lambda: asyncio.run(post_all(conc, "/v1/rollouts", [one_sample(i) for i in range(12)])))
    try:
        wait_until(
            lambda: rollouts(conc) == (ONGOING, QUEUED),
            f"{ONGOING} rollouts running (their engine calls held by the pause) and {QUEUED} waiting",
        )
        extra = httpx.post(f"{conc}/v1/rollouts", json=one_sample(99), timeout=60)
        assert extra.status_code == 429, extra.text
        assert extra.headers["retry-after"] == "1" and extra.json() == {"error": QUEUES_FULL, "detail": []}
        assert overload_count(conc) == rejected_before + 1
    finally:
        assert httpx.post(f"{conc}/v1/resume", headers=AUTH, timeout=30).status_code == 200
    t.join(300)
    assert [r.status_code for r in out[0]] == [200] * (ONGOING + QUEUED), [r.text for r in out[0]]
    assert all(len(r.json()["groups"][0]["samples"][0]["token_ids"]) == 16 for r in out[0])
    (after,) = replicas(conc)
    assert after["batch_calls"]["max"] == ONGOING  # the held calls decoded together
    assert after["rollouts_running"] == after["rollouts_waiting"] == 0
    buckets = batch_calls_buckets(conc)
    assert buckets["8"] > buckets["4"]  # /metrics shows steps of 5 to 8 calls


def test_openai_chat_requests_share_batches_too(conc):
    before = batch_calls_buckets(conc)
    assert httpx.post(f"{conc}/v1/pause", headers=AUTH, timeout=30).status_code == 200
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1.0}
    t, out = in_thread(lambda: asyncio.run(post_all(conc, "/v1/chat/completions", [body] * 3)))
    try:
        wait_until(lambda: rollouts(conc) == (3, 0), "the three chat requests running, held")
    finally:
        assert httpx.post(f"{conc}/v1/resume", headers=AUTH, timeout=30).status_code == 200
    t.join(300)
    assert [r.status_code for r in out[0]] == [200] * 3, [r.text for r in out[0]]
    after = batch_calls_buckets(conc)
    assert after["4"] - after["2"] > before["4"] - before["2"]  # steps of 3 calls


def test_health_answers_while_a_long_batch_runs(conc):
    """/healthz samples a token on the busy replica: its sample joins the running batch instead of waiting for it."""
    body = {**one_sample(0, LONG_TOKENS), "n": 2}
    t, out = in_thread(lambda: httpx.post(f"{conc}/v1/rollouts", json=body, timeout=300))
    wait_until(lambda: any_busy(conc), "the replica decoding the rollout")
    health = httpx.get(f"{conc}/healthz", timeout=60)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert t.is_alive()  # answered while the rollout still decodes
    httpx.post(f"{conc}/v1/abort", headers=AUTH, timeout=30)
    t.join(300)
    assert out and out[0].status_code == 200, out
