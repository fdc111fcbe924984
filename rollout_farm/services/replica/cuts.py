"""Cutting a rollout short by its request_id and keeping what it generated (SGLang's /abort_request of a running
/generate; DELETE /v1/rollouts/{id}?partial=true): the replica's generate calls for that request end at their next
token with finish_reason "abort" and the tokens so far, and the rollout answers normally with them, instead of being
cancelled (which loses them).

Cuts        request_id -> Cut, on each replica: the cancel events of the engine calls each running rollout made.
            cut(request_id) sets them; a rollout of that id that starts later (its call was on its way when the cut
            was broadcast) starts cut, for EARLY_S: its engine calls end at once, with no tokens.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

EARLY_S = 30.0  # how long a cut waits for a rollout of its id that has not reached this replica yet


class Cut:
    """One request_id's engine calls on this replica; `done` once cut (later calls start cancelled)."""

    def __init__(self, done: bool = False):
        self.done, self.users = done, 0
        self.events: set[threading.Event] = set()

    @contextmanager
    def call(self):
        """A cancel event for one engine call, set now if the request was cut already, or when it is."""
        cancel = threading.Event()
        if self.done:
            cancel.set()
        self.events.add(cancel)
        try:
            yield cancel
        finally:
            self.events.discard(cancel)

    def cut(self) -> int:
        self.done = True
        for e in list(self.events):
            e.set()
        return len(self.events)


class Cuts:
    def __init__(self):
        self.running: dict[str, Cut] = {}
        self.early: dict[str, float] = {}  # request_id -> when a cut arrived before its rollout

    @contextmanager
    def rollout(self, request_id: str | None):
        """The Cut of one rollout of `request_id` while it runs (None without an id: never cut)."""
        if not request_id:
            yield None
            return
        now = time.monotonic()
        self.early = {k: t for k, t in self.early.items() if now - t < EARLY_S}
        cut = self.running.setdefault(request_id, Cut(done=request_id in self.early))
        cut.users += 1
        try:
            yield cut
        finally:
            cut.users -= 1
            if not cut.users and self.running.get(request_id) is cut:
                del self.running[request_id]

    def cut(self, request_id: str) -> int:
        """Cut the rollouts of `request_id` here: how many engine calls were cut (0: none runs here now)."""
        found = self.running.get(request_id)
        if found is None:
            self.early[request_id] = time.monotonic()
            return 0
        return found.cut()
