"""How long generation waits on a paused replica: at most FARM_PAUSE_WAIT_S (0: until resume); then the rollout
answers FarmPaused (503 with Retry-After, naming the pause) and keeps nothing of that chunk.

A generate call waits on a pause in one of three places, and PauseBound bounds each:
  at the replica's gate   a call made while the replica is paused (EngineServer._generate, before the engine sees
                          it); on resume every waiter goes on at once, so the engine admits them together;
  in the engine's queue   a call that reached the engine as the pause came, or waited there behind a full batch;
  held in the batch       the running rows of a pause in mode in_place or retract (torch/hold.py).
The bound counts from the pause or from the rollout's last progress (its arrival at the replica, then the end of each
of its engine calls), whichever is later: time spent waiting for a rollout slot while paused counts too. At the
gate the call waits for the resume until then. In the engine, a watchdog running while the replica is paused sets
the cancel event of each call past the bound (it ends at its next token, or at once while queued or held). Under
mode "wait" the calls that were running when the pause came go on, and the engine tells a queued call from a
running one only by being busy, so the watchdog ends calls there once the engine runs nothing: a call queued behind
a full batch may wait past the bound for the running ones to finish (at most their max_new_tokens).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rollout_farm.services.errors import FarmPaused

WATCH_S = 0.05  # how often the watchdog looks at the engine calls while the replica is paused


@dataclass(eq=False)
class Progress:
    """One rollout's last progress on this replica (monotonic seconds): its arrival, then the end of each engine
    call it made."""

    at: float = field(default_factory=time.monotonic)

    def moved(self) -> None:
        """An engine call of the rollout ended: a later wait on a pause counts from now."""
        self.at = time.monotonic()


@dataclass(eq=False)
class Watch:
    """One engine call in flight: its rollout's Progress and its cancel event; `ended` once the watchdog cut it."""

    progress: Progress
    cancel: threading.Event
    ended: bool = False


class PauseBound:
    """The replica's pause as its generate calls see it: since when it is paused and in which mode, the gate new
    calls wait at, and the engine calls the watchdog may end. `busy` says whether the engine runs any row (Engine.busy).
    pause() and resume() run on the replica's event loop."""

    def __init__(self, limit_s: float, busy: Callable[[], bool], replica: str):
        self.limit_s, self.busy, self.replica = limit_s, busy, replica
        self.mode: str | None = None  # the pause's mode ("wait", "in_place", "retract"); None while running
        self.since = self.since_wall = 0.0  # when the pause began (monotonic, and wall clock for the error)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._watches: set[Watch] = set()
        self._watchdog: asyncio.Task | None = None

    @property
    def paused(self) -> bool:
        return self.mode is not None

    def pause(self, mode: str) -> None:
        """Close the gate (the pause's start stays that of the first pause until resume)."""
        if self.mode is None:
            self.since, self.since_wall = time.monotonic(), time.time()
            self._resumed.clear()
            if self.limit_s and (self._watchdog is None or self._watchdog.done()):
                self._watchdog = asyncio.create_task(self._watch())
        self.mode = mode

    def resume(self) -> None:
        """Open the gate: every call waiting at it goes on now."""
        self.mode = None
        self._resumed.set()

    def deadline(self, progress: Progress) -> float:
        """When a call of this rollout stops waiting on the current pause (monotonic seconds; inf: no bound)."""
        return max(progress.at, self.since) + self.limit_s if self.limit_s else float("inf")

    async def admitted(self, progress: Progress) -> None:
        """Return once the replica is not paused; FarmPaused once the rollout has waited on the pause to the bound."""
        while self.paused:
            left = self.deadline(progress) - time.monotonic()
            try:
                await asyncio.wait_for(self._resumed.wait(), None if left == float("inf") else max(0.0, left))
            except asyncio.TimeoutError:  # TimeoutError from 3.11; a class of its own on 3.10
                raise self.error(progress) from None

    @contextmanager
    def watched(self, progress: Progress, cancel: threading.Event) -> Iterator[Watch]:
        """Around one engine call: the watchdog may set `cancel` (watch.ended) once the call waited to the bound."""
        watch = Watch(progress, cancel)
        self._watches.add(watch)
        try:
            yield watch
        finally:
            self._watches.discard(watch)

    def overdue(self, now: float) -> list[Watch]:
        """The engine calls to end now: past the bound of a pause, and under mode "wait" only while the engine runs
        nothing (the calls left are then queued, not running)."""
        if not self.paused or not self.limit_s:
            return []
        late = [w for w in self._watches if not w.ended and now >= self.deadline(w.progress)]
        return [] if late and self.mode == "wait" and self.busy() else late

    async def _watch(self) -> None:
        """While paused: end the overdue engine calls through their cancel events."""
        while self.paused:
            await asyncio.sleep(WATCH_S)
            for watch in self.overdue(time.monotonic()):
                watch.ended = True
                watch.cancel.set()

    def error(self, progress: Progress) -> FarmPaused:
        waited = time.monotonic() - max(progress.at, self.since)
        return FarmPaused.waited(self.replica, self.since_wall, waited, self.limit_s)
