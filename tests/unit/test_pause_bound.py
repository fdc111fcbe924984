"""The bound on a wait on a paused replica (rollout_farm/services/replica/pause_bound.py), without Ray: the gate, the
watchdog's choice of calls to end, the clock it counts from, and the 503 it answers."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time

import pytest

from rollout_farm.services.api.errors import response
from rollout_farm.services.errors import FarmPaused, as_service_error
from rollout_farm.services.replica.pause_bound import WATCH_S, PauseBound, Progress

LIMIT_S = 0.3


def bound(limit_s: float = LIMIT_S, busy: bool = False) -> PauseBound:
    return PauseBound(limit_s, lambda: busy, "r0")


def test_a_call_at_a_running_replica_goes_on_at_once():
    async def main():
        pauses = bound()
        start = time.monotonic()
        await pauses.admitted(Progress())
        return time.monotonic() - start

    assert asyncio.run(main()) < LIMIT_S / 3


def test_a_call_at_a_paused_replica_gets_farm_paused_at_the_bound_and_not_before():
    async def main():
        pauses = bound()
        pauses.pause("wait")
        start = time.monotonic()
        with pytest.raises(FarmPaused) as caught:
            await pauses.admitted(Progress())
        return time.monotonic() - start, caught.value

    waited, error = asyncio.run(main())
    assert LIMIT_S - 0.01 <= waited < LIMIT_S + 5  # asyncio may fire a timer a clock tick early; the top: a hang
    assert error.status == 503 and error.retry_after_s == 1
    assert "the farm is paused" in error.message and "FARM_PAUSE_WAIT_S=0.3" in error.message
    assert "replica r0 since" in error.message and "POST /v1/resume" in error.message
    assert error.detail[0]["field"] == "paused" and "waited 0.3 s" in error.detail[0]["message"]


def test_a_resume_lets_every_waiting_call_go_on():
    async def main():
        pauses = bound(limit_s=60)
        pauses.pause("wait")
        waiters = [asyncio.create_task(pauses.admitted(Progress())) for _ in range(5)]
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiters)
        pauses.resume()
        await asyncio.wait_for(asyncio.gather(*waiters), 5)  # none raised

    asyncio.run(main())


def test_without_a_bound_a_call_waits_until_the_resume():
    """The negative control of the bound: FARM_PAUSE_WAIT_S=0 keeps the call waiting well past LIMIT_S."""

    async def main():
        pauses = bound(limit_s=0)
        pauses.pause("wait")
        waiter = asyncio.create_task(pauses.admitted(Progress()))
        await asyncio.sleep(3 * LIMIT_S)
        assert not waiter.done()
        assert pauses.overdue(time.monotonic() + 3600) == []
        pauses.resume()
        await asyncio.wait_for(waiter, 5)

    asyncio.run(main())


def test_the_wait_counts_from_the_pause_or_the_rollouts_last_progress_whichever_is_later():
    async def main():
        pauses = bound(limit_s=10)
        before = Progress()  # arrived (or last moved) before the pause
        before.at -= 100
        pauses.pause("wait")
        assert pauses.deadline(before) == pytest.approx(pauses.since + 10)
        after = Progress()
        after.at = pauses.since + 4  # arrived during the pause, e.g. then waited for a rollout slot
        assert pauses.deadline(after) == pytest.approx(pauses.since + 14)
        after.moved()  # an engine call of it ended: a later wait counts anew
        assert pauses.deadline(after) >= time.monotonic() + 9
        pauses.pause("in_place")  # a second pause while paused keeps the first one's start
        assert pauses.deadline(before) == pytest.approx(pauses.since + 10) and pauses.mode == "in_place"

    asyncio.run(main())


@pytest.mark.parametrize(
    "mode, busy, ended",
    [
        ("wait", True, False),  # running calls go on under a plain pause: the queued one waits for them
        ("wait", False, True),  # nothing runs: what is left is queued, and past the bound
        ("in_place", True, True),  # held rows are bounded too
        ("retract", False, True),
    ],
)
def test_the_watchdog_ends_the_engine_calls_past_the_bound(mode, busy, ended):
    async def main():
        pauses = bound(limit_s=0.2, busy=busy)
        cancel = threading.Event()
        with pauses.watched(Progress(), cancel) as watch:
            pauses.pause(mode)
            await asyncio.sleep(0.2 + 10 * WATCH_S)
            assert watch.ended is ended and cancel.is_set() is ended
            pauses.resume()

    asyncio.run(main())


def test_the_watchdog_leaves_calls_within_the_bound_and_after_the_resume():
    async def main():
        pauses = bound(limit_s=60)
        cancel = threading.Event()
        with pauses.watched(Progress(), cancel) as watch:
            pauses.pause("in_place")
            await asyncio.sleep(5 * WATCH_S)
            pauses.resume()
            await asyncio.sleep(5 * WATCH_S)
        assert not watch.ended and not cancel.is_set()
        assert pauses.overdue(time.monotonic() + 3600) == []  # not paused

    asyncio.run(main())


def test_farm_paused_crosses_ray_and_answers_503_with_retry_after():
    error = FarmPaused.waited("r0", time.time() - 5, 2.04, 2)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is FarmPaused and again.message == error.message and again.detail == error.detail
    answer = response(as_service_error(again))
    body = json.loads(answer.body)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert body["error"].startswith("the farm is paused") and "waited 2.0 s" in body["error"]
