"""Coalescing at the ingress (FARM_COALESCE_MS, FARM_FRONT=split): one-replica rollouts that arrive within a short
window go to one engine replica as one Ray call (`EngineServer.rollout_many`), which runs them as it runs separate
calls (each admitted, each answered on its own). What it saves is Serve's handle routing and submission per call, the
larger part of the ingress's CPU per one-sample request. What it costs: the window's wait, and a batch that meets a
dead replica fails whole (each of its rollouts a 503 with Retry-After, as one call would). A cancelled rollout of a
batch already sent is cut on the replicas by its request_id where it has one; without one its engine work runs on.
"""

from __future__ import annotations

import asyncio

from rollout_farm.services.replica.handle import ReplicaCall, Replicas

MAX_CALLS = 64  # rollouts in one batch at most


class Coalescing(Replicas):
    """Replicas whose single, unkeyed rollout calls are batched over FARM_COALESCE_MS."""

    def __init__(self, handle, window_s: float):
        super().__init__(handle)
        self.window_s = window_s
        self.pending: list[tuple[tuple, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None

    def call(self, method: str, *args, key: str | None = None, local: bool = True) -> ReplicaCall:
        if method != "rollout" or key is not None:
            return super().call(method, *args, key=key)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((args, future))
        if len(self.pending) >= MAX_CALLS:
            self.flush()
        elif self.timer is None:
            self.timer = loop.call_later(self.window_s, self.flush)
        return ReplicaCall(Sent(future, self, args), method)

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = [(a, f) for a, f in self.pending if not f.done()], []
        if batch:
            asyncio.ensure_future(self.send(batch))

    async def send(self, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        try:
            results = await super().call("rollout_many", [args for args, _ in batch])
        except BaseException as e:  # back-pressure, a dead replica: every rollout of the batch answers it
            results = [e] * len(batch)
        for (_, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)


class Sent:
    """One rollout's part of a batch, as ReplicaCall awaits and cancels a Serve response."""

    def __init__(self, future: asyncio.Future, owner: Coalescing, args: tuple):
        self.future, self.owner, self.args = future, owner, args

    def __await__(self):
        return self.future.__await__()

    def cancel(self) -> None:
        if self.future.done():
            return
        self.future.cancel()
        request_id = self.args[8]  # EngineServer.rollout's request_id
        if request_id:  # the batch's replica is not known here: every replica cuts it
            asyncio.ensure_future(self.owner.each("cut_rollout", request_id))
