"""Pause, resume, abort, readiness and backpressure against the real service."""

import asyncio
import time

import httpx
import pytest

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from tests.conftest import TOKEN
from tests.service.helpers import in_thread, wait_until

LONG = P.RolloutRequest(
    prompts=[P.Prompt(token_ids=[40, 41, 42])],
    n=8,
    sampling_params=P.SamplingParams(max_new_tokens=4000, ignore_eos=True, seed=0),
)


def test_control_needs_the_token(service):
    for action in ("pause", "resume", "abort"):
        assert httpx.post(f"{service}/v1/{action}").status_code == 401


def test_pause_holds_new_rollouts_until_resume(service, client):
    short = P.RolloutRequest(
        prompts=[P.Prompt(text="Q: 1+1\nA:")], n=2, sampling_params=P.SamplingParams(max_new_tokens=4)
    )
    try:
        states = client.control("pause").replicas
        assert len(states) == 2 and all(s.paused for s in states)
        assert client.health().status == "paused"
        r = httpx.get(f"{service}/readyz")
        assert r.status_code == 503 and "paused" in str(r.json()["detail"])
        t, out = in_thread(lambda: client.rollouts(short))
        t.join(2.0)
        assert t.is_alive() and not out  # held, not failed
    finally:
        assert not any(s.paused for s in client.control("resume").replicas)
    t.join(60)
    assert len(out[0].groups[0].samples) == 2
    assert httpx.get(f"{service}/readyz").json()["ready"] is True
    assert client.health().status == "ok"


def test_abort_ends_the_running_generation(client):
    t, out = in_thread(lambda: client.rollouts(LONG))
    while t.is_alive():  # abort until it lands inside the running generation
        time.sleep(0.5)
        client.control("abort")
    samples = out[0].groups[0].samples
    assert all(s.finish_reason == "abort" and 0 < len(s.token_ids) < 4000 for s in samples)
    assert all(len(s.logprobs) == len(s.token_ids) for s in samples)


def test_ignore_eos_generates_exactly_max_new_tokens(client):
    req = P.RolloutRequest(
        prompts=[P.Prompt(text="hi")], n=4, sampling_params=P.SamplingParams(max_new_tokens=40, ignore_eos=True, seed=1)
    )
    assert all(len(s.token_ids) == 40 and s.finish_reason == "length" for s in client.rollouts(req).groups[0].samples)


def test_full_engine_queues_answer_429_with_retry_after(service, client):
    """Twelve rollouts at once: the replicas take what they hold, the rest get 429. Nothing left to chance: they are
    sent while the replicas are paused, so none finishes and frees a place before the others arrive (two replicas
    hold 2 x (2 running + their share of 2 waiting) < 12); resumed once a 429 came back."""
    body = LONG.model_copy(
        update={"sampling_params": LONG.sampling_params.model_copy(update={"max_new_tokens": 400})}
    ).model_dump()
    answered: list[httpx.Response] = []

    async def post_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as http:

            async def one() -> httpx.Response:
                answered.append(r := await http.post(f"{service}/v1/rollouts", json=body))
                return r

            return await asyncio.gather(*[one() for _ in range(12)])

    assert all(s.paused for s in client.control("pause").replicas)
    try:
        t, out = in_thread(lambda: asyncio.run(post_all()))
        wait_until(lambda: any(r.status_code == 429 for r in answered), "a 429 while the paused replicas hold the rest")
    finally:
        assert not any(s.paused for s in client.control("resume").replicas)
    t.join(300)
    codes = [r.status_code for r in out[0]]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    rejected = next(r for r in out[0] if r.status_code == 429)
    assert rejected.headers["retry-after"] == "1" and "FARM_ENGINE_MAX_QUEUED_REQUESTS" in rejected.json()["error"]


def test_unknown_control_action_is_an_error(service):
    with FarmClient(service, TOKEN, retries=0) as c:
        with pytest.raises(ValueError, match="pause, resume, abort"):  # refused before it is sent
            c.control("bogus")
    r = httpx.post(f"{service}/v1/bogus", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code in (404, 405) and "error" in r.json()
