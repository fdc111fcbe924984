"""Rollout jobs at the ingress: the request_id table (replays, cancellation) and the disconnect grace.

A job's groups are recorded as they finish, so a replay or a stream sees them in finishing order. A job with
a request_id runs in a context of its own: Serve cancels the engine calls made in a request's context when
its caller leaves, and the job outlives its caller by FARM_DISCONNECT_GRACE_S, for a retry to pick it up.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable

from services import metrics
from services import protocol as P
from services.api.errors import as_service_error
from services.errors import Conflict, RolloutCancelled
from services.settings import ServiceSettings

log = logging.getLogger("farm.service")


class Job:
    """One rollout request: its groups in the order they finished, and the task making them."""

    def __init__(self, size: int, fingerprint: str = ""):
        self.size, self.fingerprint = size, fingerprint
        self.groups: dict[int, P.Group] = {}  # prompt index -> group, in finishing order
        self.task: asyncio.Task | None = None
        self.report: P.FilterReport | None = None  # dynamic_group_filter's, once done
        self.waiters = 0  # callers still waiting: when the last one goes away, so does the engine work
        self._tick = asyncio.Event()

    def add(self, index: int, group: P.Group) -> None:
        self.groups[index] = group
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def events(self) -> AsyncIterator[tuple[int, P.Group]]:
        """(index, group) as each group finishes, replaying those already done; then the task's exception, if any."""
        sent = 0
        while True:
            tick = self._tick
            items = list(self.groups.items())
            for item in items[sent:]:
                yield item
            sent = len(items)
            if self.task.done() and sent == len(self.groups):
                break
            waiter = asyncio.ensure_future(tick.wait())
            await asyncio.wait({self.task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        if self.task.cancelled():
            raise RolloutCancelled()
        self.task.result()


def fingerprint(req: P.RolloutRequest) -> str:
    """What makes two requests under one request_id the same request."""
    return hashlib.sha256(req.model_dump_json(exclude={"request_id", "stream"}).encode()).hexdigest()


class RolloutJobs:
    """request_id -> job. A repeat of an id (also while it runs) gets the first job; the same id with another body
    gets 409. Failed and cancelled jobs are forgotten, so a retry generates again; the oldest finished are evicted."""

    def __init__(self, settings: ServiceSettings):
        self.settings = settings
        self.jobs: OrderedDict[str, Job] = OrderedDict()

    def start(self, req: P.RolloutRequest, produce: Callable[[Job], Awaitable[P.RolloutResponse]]) -> Job:
        """The running or finished job of this request_id, or a new one running produce(job)."""
        key = fingerprint(req)
        job = self.jobs.get(req.request_id) if req.request_id else None
        if job is not None:
            if job.fingerprint != key:
                raise Conflict(f"request_id {req.request_id!r} was used for a different request: use a new id")
            metrics.REPLAYS.inc()
            return job
        job = Job(len(req.prompts), key)
        job.task = contextvars.Context().run(asyncio.create_task, produce(job))
        if req.request_id:
            self.jobs[req.request_id] = job
            self._evict()
            job.task.add_done_callback(lambda _, rid=req.request_id: self._forget_failed(rid, job))
        return job

    def _evict(self) -> None:
        while len(self.jobs) > self.settings.idempotency_cache_size:
            old = next((rid for rid, j in self.jobs.items() if j.task.done()), None)
            if old is None:
                return
            del self.jobs[old]

    def _forget_failed(self, request_id: str, job: Job) -> None:
        if (job.task.cancelled() or job.task.exception() is not None) and self.jobs.get(request_id) is job:
            del self.jobs[request_id]

    def cancel(self, request_id: str) -> bool:
        """Cancel a running job; False when none with this id runs."""
        job = self.jobs.get(request_id)
        if job is None or job.task.done():
            return False
        del self.jobs[request_id]
        job.task.cancel()
        log.info("rollout_cancelled", extra={"request_id": request_id})
        return True

    async def result(self, job: Job, request_id: str | None) -> P.RolloutResponse:
        """The job's response once it is done; its error, if it failed."""
        job.waiters += 1
        try:
            await asyncio.wait({job.task})
        except asyncio.CancelledError:  # our caller went away
            job.waiters -= 1
            self._abandoned(job, request_id)
            raise
        job.waiters -= 1
        if job.task.cancelled():
            raise RolloutCancelled()
        return job.task.result()

    async def lines(self, job: Job, request_id: str | None) -> AsyncIterator[str]:
        """NDJSON: a GroupEvent per finished group, then a StreamEnd (with the error's status if the job failed)."""
        job.waiters += 1
        try:
            async for index, group in job.events():
                yield P.GroupEvent(index=index, group=group).model_dump_json() + "\n"
            yield P.StreamEnd(groups=len(job.groups), filter=job.report).model_dump_json() + "\n"
        except (asyncio.CancelledError, GeneratorExit):
            job.waiters -= 1
            self._abandoned(job, request_id)
            raise
        except Exception as e:
            error = as_service_error(e)
            yield P.StreamEnd(groups=len(job.groups), error=error.message, status=error.status).model_dump_json() + "\n"

    def _abandoned(self, job: Job, request_id: str | None) -> None:
        """A caller went away. With none left, the engine work is cancelled: at once without a request_id, else
        after FARM_DISCONNECT_GRACE_S unless a retry under the same id (a client whose read timed out) waits for it
        by then."""
        if job.waiters > 0:
            return
        if not request_id or self.settings.disconnect_grace_s == 0:
            job.task.cancel()
            return
        asyncio.get_running_loop().call_later(
            self.settings.disconnect_grace_s, lambda: job.waiters == 0 and job.task.cancel()
        )
