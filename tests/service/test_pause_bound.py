"""A paused farm holds no request forever (FARM_PAUSE_WAIT_S), through HTTP on apps of their own: one replica of the
tiny model with a bound of BOUND_S, and one with no bound (0), the negative control.

Nothing is left to timing: each wait is for a state the service reports (a rollout running on the replica, a queue
source's counters), and the durations asserted are lower bounds that hold by construction (a request measured from
before it was sent waits at least the bound) or generous ceilings that only catch a hang."""

import asyncio
import re
import time

import httpx
import pytest

from tests.service.helpers import AUTH, in_thread, replica_metric, rollout, second_app, tokens, wait_until

BOUND_S = 3.0
ROLLOUT = {
    "prompts": [{"token_ids": [40, 41, 42]}],
    "n": 2,
    "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 3},
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1.0}


def app(service, tiny_model, tmp_path_factory, name: str, pause_wait_s: float):
    return second_app(
        service,
        name,
        model=str(tiny_model),
        replicas=1,
        ingress_replicas=1,
        engine_max_ongoing_requests=2,  # so that a third rollout waits for a slot
        engine_max_queued_requests=4,
        pause_wait_s=pause_wait_s,
        state_dir=str(tmp_path_factory.mktemp(f"{name}-state")),
    )


@pytest.fixture(scope="module")
def bounded(service, tiny_model, tmp_path_factory):
    with app(service, tiny_model, tmp_path_factory, "pausebound", BOUND_S) as url:
        yield url


@pytest.fixture(scope="module")
def unbounded(service, tiny_model, tmp_path_factory):
    with app(service, tiny_model, tmp_path_factory, "pauseforever", 0) as url:
        yield url


def control(url: str, action: str) -> dict:
    r = httpx.post(f"{url}/v1/{action}", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def running(url: str) -> float:
    """Rollouts running on the one replica (their slot taken; while paused, waiting on the pause)."""
    return sum(replica_metric(url, "farm_replica_rollouts_running").values())


def timed(fn):
    """fn, returning (seconds it took from before the request was sent, its response)."""

    def run():
        start = time.monotonic()
        response = fn()
        return time.monotonic() - start, response

    return run


def assert_names_the_pause(took: float, r: httpx.Response) -> float:
    """The 503 of a wait on the pause; how long the replica says the request waited."""
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    error = r.json()["error"]
    assert error.startswith("the farm is paused") and f"FARM_PAUSE_WAIT_S={BOUND_S:g}" in error, error
    assert "since" in error and "POST /v1/resume" in error and r.json()["detail"][0]["field"] == "paused"
    waited = float(re.search(r"waited ([\d.]+) s", error).group(1))  # the replica's own count
    assert BOUND_S <= waited < BOUND_S + 30, error  # the upper end only catches a hang
    assert took >= BOUND_S * 0.999 and took < BOUND_S + 60
    return waited


def test_a_paused_farm_answers_rollouts_and_chat_503_naming_the_pause_after_the_bound(bounded):
    """A rollout (with a request_id) and an OpenAI chat request sent to a paused farm each answer 503 with
    Retry-After naming the pause, not before the bound; nothing is lost: after the resume the same requests
    succeed, the rollout under its request_id running anew."""
    with_id = {**ROLLOUT, "request_id": "paused-rollout-1"}
    control(bounded, "pause")
    try:
        t1, rolled = in_thread(timed(lambda: rollout(bounded, with_id, timeout=BOUND_S + 120)))
        t2, chatted = in_thread(
            timed(lambda: httpx.post(f"{bounded}/v1/chat/completions", json=CHAT, timeout=BOUND_S + 120))
        )
        t1.join(BOUND_S + 120)
        t2.join(BOUND_S + 120)
        assert not t1.is_alive() and not t2.is_alive(), "a request on the paused farm never came back"
        states = control(bounded, "pause")["replicas"]  # still paused: the 503s came from the bound, not a resume
        assert all(s["paused"] for s in states)
    finally:
        control(bounded, "resume")
    assert isinstance(rolled[0], tuple) and isinstance(chatted[0], tuple), (rolled, chatted)  # not a read timeout
    assert_names_the_pause(*rolled[0])
    assert_names_the_pause(*chatted[0])
    again = rollout(bounded, with_id)  # the replay of the failed request_id runs it anew
    assert [len(t) for t in tokens(again)] == [8, 8]
    chat = httpx.post(f"{bounded}/v1/chat/completions", json=CHAT, timeout=120)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant", chat.text


def test_a_resume_during_the_wait_lets_the_waiting_request_succeed(unbounded):
    """A rollout waiting on a pause answers 200 once the farm resumes. On the app with no bound, so that the resume
    and not a deadline ends the wait whatever the machine's load (with a bound, a slow machine could reach it
    first: a failure by chance); the bound's own gate opening on a resume is tests/unit/test_pause_bound.py's."""
    control(unbounded, "pause")
    try:
        t, out = in_thread(lambda: rollout(unbounded, ROLLOUT, timeout=300))
        wait_until(lambda: running(unbounded) == 1, "the rollout on the paused replica")
        assert not out, "answered while paused"
    finally:
        control(unbounded, "resume")
    t.join(300)
    assert out and out[0].status_code == 200, out
    assert [len(x) for x in tokens(out[0])] == [8, 8]


def test_the_queue_keeps_its_prompts_through_a_pause_and_generates_them_after(bounded):
    """The queue's background generation on a paused farm: its batch waits to the bound, goes back to pending,
    and is not an error; after the resume both prompts' groups arrive."""
    prompts = [{"text": f"Q: {a}+1\nA:", "ground_truth": str(a + 1)} for a in (3, 5)]
    spec = {"name": "paused-q", "prompts": prompts, "n": 2, "target_groups": 4}
    spec["sampling_params"] = {"max_new_tokens": 4, "temperature": 1.0}

    def state() -> dict:
        found = httpx.get(f"{bounded}/v1/queue/sources", timeout=30).json()
        return next(s for s in found if s["name"] == "paused-q")

    control(bounded, "pause")
    try:
        r = httpx.post(f"{bounded}/v1/queue/sources", json=spec, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        seen = wait_until(lambda: (s := state())["generation_busy_s"] >= BOUND_S and s, "a batch waited the bound")
        assert seen["error"] is None and seen["ready"] == 0, seen  # delayed, not failed
    finally:
        control(bounded, "resume")
    wait_until(lambda: state()["ready"] == 2, "both groups generated after the resume")
    pulled = httpx.post(
        f"{bounded}/v1/queue/pull", json={"source": "paused-q", "max_groups": 4}, headers=AUTH, timeout=60
    ).json()["items"]
    assert sorted(i["prompt"]["text"] for i in pulled) == sorted(p["text"] for p in prompts)
    assert all(len(i["group"]["samples"]) == 2 for i in pulled) and state()["error"] is None
    httpx.delete(f"{bounded}/v1/queue/sources/paused-q", headers=AUTH, timeout=30)


def test_with_no_bound_a_paused_request_waits_until_the_resume(unbounded):
    """The negative control (FARM_PAUSE_WAIT_S=0): the same rollout is still waiting at twice the bound, where the
    bounded app has answered 503; the resume then lets it finish."""
    control(unbounded, "pause")
    try:
        t, out = in_thread(lambda: rollout(unbounded, ROLLOUT, timeout=300))
        wait_until(lambda: running(unbounded) == 1, "the rollout on the paused replica")
        t.join(2 * BOUND_S)
        assert t.is_alive() and not out, out
    finally:
        control(unbounded, "resume")
    t.join(120)
    assert [len(x) for x in tokens(out[0])] == [8, 8]


def test_a_rollout_that_waited_for_a_slot_does_not_wait_a_second_bound(bounded):
    """Six rollouts on a paused replica that runs two at once: the four others wait for a slot, which frees when the
    first two answer 503 at their bound. Their wait counts from their arrival, slot wait included, so each answers
    at about one bound, where counting from the slot would make it about two (the ceiling leaves BOUND_S of slack
    for a slow replica)."""
    bodies = [{**ROLLOUT, "sampling_params": {**ROLLOUT["sampling_params"], "seed": i}} for i in range(6)]

    async def post_all() -> list[tuple[float, httpx.Response]]:
        async with httpx.AsyncClient(timeout=BOUND_S + 120) as http:

            async def one(body):
                start = time.monotonic()
                r = await http.post(f"{bounded}/v1/rollouts", json=body)
                return time.monotonic() - start, r

            return await asyncio.gather(*[one(b) for b in bodies])

    control(bounded, "pause")
    try:
        answers = asyncio.run(post_all())
    finally:
        control(bounded, "resume")
    assert [r.status_code for _, r in answers] == [503] * 6, [r.text for _, r in answers]
    for took, r in answers:
        assert_names_the_pause(took, r)
        # counted from the slot, the last four would take at least two bounds (a slot frees after one): the client's
        # own clock, not the replica's count, which the same mistake would move too
        assert took < 2 * BOUND_S, took
