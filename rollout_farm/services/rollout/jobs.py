"""Rollout jobs at the ingress: the request_id records (replays, cancellation) and the disconnect grace.

A job's groups are recorded as they finish, so a replay or a stream sees them in finishing order. A job with
a request_id runs in a context of its own: Serve cancels the engine calls made in a request's context when
its caller leaves, and the job outlives its caller by FARM_DISCONNECT_GRACE_S, for a retry to pick it up.

The records live in Redis, shared by every ingress replica (keys under farm:<app>:job:<request_id>):
  (hash)    fp: the body's fingerprint; state: running, done or failed; result (done); error, status (failed)
  :groups   list: the GroupEvents in finishing order, for a replay that streams
  :owner    the running replica's claim (state/redis_client.py Owner): a record whose owner lapsed is run again
  :cancel   set by DELETE /v1/rollouts/{id} on another replica; the owner cancels at its next heartbeat, and the
            DELETE waits for that to answer honestly (cancelled: false when the job finished first)
  :waiting  refreshed by a replay waiting on another replica, so the owner's disconnect grace does not cancel
A replay on the running replica follows the job in memory; on another replica it polls the record.
Finished records expire after FARM_IDEMPOTENCY_TTL_S; failed and cancelled ones are run again by a new request.

A tenant's request_ids are its own (owned()): the route keys its job under its tenant, a NUL, then the id: which no
caller can send (a request's text may hold no NUL), so two tenants, or a tenant and a caller without one, using
the same id never replay, cancel or cut each other's rollout. The admin's and anyone's ids are kept as sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import WatchError

from rollout_farm.services import protocol as P
from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.errors import Conflict, RolloutCancelled, ServiceError, as_service_error, described
from rollout_farm.services.observability import metrics
from rollout_farm.services.state.redis_client import Owner

log = logging.getLogger("farm.service")

HEARTBEAT_S = 1.0
POLL_S = 0.05
CUT_WAIT_S = 10.0  # how long a cut rollout may take to answer with what it had, before it is cancelled outright
RECORD_WAIT_S = 5.0  # how long a failed job's caller waits for its record to say so (Redis slow or away: no longer)


OWNED = "\0"  # between a tenant and its request_id in the id a job is kept under


def owned(request_id: str | None, tenant: str | None) -> str | None:
    """The id a request's job is kept under (its record, its replay, its cancel and cut on the replicas): a tenant's
    own; the admin's and anyone's as sent."""
    return f"{tenant}{OWNED}{request_id}" if request_id and tenant else request_id


def shown(request_id: str) -> str:  # the request_id as its caller sent it
    return request_id.rpartition(OWNED)[2]


class Job:
    """One rollout request run here: its groups in the order they finished, and the task making them."""

    def __init__(self, size: int, fingerprint: str = ""):
        self.size, self.fingerprint = size, fingerprint
        self.groups: dict[int, P.Group] = {}  # prompt index -> group, in finishing order
        self.task: asyncio.Task | None = None
        self.report: P.FilterReport | None = None  # dynamic_group_filter's, once done
        self.waiters = 0  # callers still waiting: when the last one goes away, so does the engine work
        self.recorded = asyncio.Event()  # set once its record holds its outcome (a job with a request_id)
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


class RemoteJob:
    """A rollout another ingress replica runs or ran, followed through its record."""

    def __init__(self, key: str):
        self.key = key


class RunAgain(Exception):
    """The record went away (its run failed, was cancelled, or its owner died): the replay runs the request."""


def fingerprint(req: P.RolloutRequest) -> str:
    """What makes two requests under one request_id the same request."""
    return hashlib.sha256(req.model_dump_json(exclude={"request_id", "stream"}).encode()).hexdigest()


class RolloutJobs:
    """request_id -> job. A repeat of an id (also while it runs, through any ingress replica) gets the first job;
    the same id with another body gets 409."""

    def __init__(self, settings: ServiceSettings, r: Redis, prefix: str):
        self.settings, self.r, self.prefix = settings, r, prefix
        self.owner = Owner(r)
        self.jobs: dict[str, Job] = {}  # the jobs with a request_id running here
        self.background: set[asyncio.Task] = set()  # held, so that the loop does not collect them mid-run

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def key(self, request_id: str) -> str:
        return f"{self.prefix}:job:{request_id}"

    async def start(self, req: P.RolloutRequest, produce: Callable[[Job], Awaitable[P.RolloutResponse]]) -> Job:
        """The running or finished job of this request_id, or a new one running produce(job)."""
        fp = fingerprint(req)
        if not req.request_id:
            return self._run(req, produce, fp)
        if (job := self.jobs.get(req.request_id)) is not None:
            if job.fingerprint != fp:
                raise self._conflict(req.request_id)
            metrics.REPLAYS.inc()
            return job
        key = self.key(req.request_id)
        for _ in range(10):
            if await self._claim(key, fp):
                job = self.jobs[req.request_id] = self._run(req, produce, fp)
                self.spawn(self._mirror(req.request_id, key, job))
                return job
            record = await self.r.hmget(key, "fp", "state")
            if record[0] is None:  # deleted between the two calls
                continue
            if record[0] != fp:
                raise self._conflict(req.request_id)
            metrics.REPLAYS.inc()
            return RemoteJob(key)
        raise Conflict(f"request_id {shown(req.request_id)!r} is being claimed by another request: send it again")

    @staticmethod
    def _conflict(request_id: str) -> Conflict:
        return Conflict(f"request_id {shown(request_id)!r} was used for a different request: use a new id")

    async def _claim(self, key: str, fp: str) -> bool:
        """Make this replica the record's owner: a new record, or one whose run failed or whose owner died."""
        async with self.r.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key, f"{key}:owner")
                state = await pipe.hget(key, "state")
                if state == "done" or (state == "running" and await pipe.exists(f"{key}:owner")):
                    return False
                pipe.multi()
                pipe.delete(key, f"{key}:groups", f"{key}:cancel")
                pipe.hset(key, mapping={"fp": fp, "state": "running"})
                pipe.expire(key, int(self.settings.idempotency_ttl_s))
                pipe.set(f"{key}:owner", self.owner.me, px=self.owner.ttl_ms)
                await pipe.execute()
                return True
            except WatchError:
                return False

    def _run(self, req: P.RolloutRequest, produce, fp: str) -> Job:
        job = Job(len(req.prompts), fp)
        job.task = contextvars.Context().run(asyncio.create_task, produce(job))
        return job

    async def _mirror(self, request_id: str, key: str, job: Job) -> None:
        """Copy the job's groups and its outcome into its record, for replays on other replicas."""
        ttl = int(self.settings.idempotency_ttl_s)
        try:
            try:
                async for index, group in job.events():
                    await self.r.rpush(f"{key}:groups", P.GroupEvent(index=index, group=group).model_dump_json())
                outcome = {"state": "done", "result": job.task.result().model_dump_json()}
            except Exception as e:
                error = as_service_error(e)
                outcome = {
                    "state": "failed",
                    "error": error.message,
                    "status": error.status,
                    "retry_after": error.retry_after_s or 0,
                }
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=outcome).expire(key, ttl).expire(f"{key}:groups", ttl)
                pipe.delete(f"{key}:owner", f"{key}:cancel")
                await pipe.execute()
        except Exception as e:  # Redis away: the record's owner lapses, and a replay runs the request again
            log.warning("rollout_record_failed", extra={"request_id": request_id, "error": described(e)})
        finally:
            if self.jobs.get(request_id) is job:
                del self.jobs[request_id]
            job.recorded.set()

    async def heartbeat(self) -> None:
        """Forever: keep the records of the jobs running here owned, and act on cancels sent to other replicas."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            for request_id, job in list(self.jobs.items()):
                key = self.key(request_id)
                try:
                    await self.owner.extend(f"{key}:owner")
                    for k in (key, f"{key}:groups"):
                        await self.r.expire(k, int(self.settings.idempotency_ttl_s))
                    if await self.r.exists(f"{key}:cancel"):
                        self.cancel_here(request_id)
                except Exception as e:
                    log.warning("rollout_heartbeat_failed", extra={"request_id": request_id, "error": described(e)})

    def cancel_here(self, request_id: str) -> bool:
        job = self.jobs.get(request_id)
        if job is None or job.task.done():
            return False
        job.task.cancel()
        log.info("rollout_cancelled", extra={"request_id": request_id})
        return True

    async def cancel(self, request_id: str) -> bool:
        """Cancel a running job, here or on another replica; False when none with this id runs."""
        if self.cancel_here(request_id):
            return True
        key = self.key(request_id)
        if await self.r.hget(key, "state") != "running" or not await self.r.exists(f"{key}:owner"):
            return False
        await self.r.set(f"{key}:cancel", 1, px=60_000)
        return await self._cancelled_remotely(key)

    async def cut(self, request_id: str, cut: Callable[[], Awaitable]) -> tuple[bool, list[P.Group] | None]:
        """Cut a running job short, keeping what it generated: cut() ends its engine calls at their next token on
        every replica (rollout_farm/services/replica/cuts.py), and the job answers with them, here or on the ingress
        replica that runs it; its record keeps that answer for replays. Returns whether one was running, and its groups:
        finished ones whole, the others' samples finished 'abort' with their tokens so far, every sample with its
        token_weight_versions. One that has not answered within CUT_WAIT_S is cancelled outright: its finished
        groups only."""
        job = self.jobs.get(request_id)
        if job is not None and not job.task.done():
            await cut()
            await asyncio.wait({job.task}, timeout=CUT_WAIT_S)
            if job.task.done() and not job.task.cancelled() and job.task.exception() is None:
                return True, versioned(job.task.result().groups)
            self.cancel_here(request_id)
            return True, versioned(list(job.groups.values()))
        key = self.key(request_id)
        if await self.r.hget(key, "state") != "running" or not await self.r.exists(f"{key}:owner"):
            return False, None
        await cut()
        deadline = asyncio.get_running_loop().time() + CUT_WAIT_S
        while asyncio.get_running_loop().time() < deadline:
            record = await self.r.hmget(key, "state", "result")
            if record[0] == "done":
                return True, versioned(P.RolloutResponse.model_validate_json(record[1]).groups)
            if record[0] != "running":
                break
            await asyncio.sleep(POLL_S)
        else:
            await self.r.set(f"{key}:cancel", 1, px=60_000)
        lines = await self.r.lrange(f"{key}:groups", 0, -1)
        return True, versioned([P.GroupEvent.model_validate_json(x).group for x in lines])

    async def _cancelled_remotely(self, key: str) -> bool:
        """Wait for the owner's next heartbeat to act on the cancel: False if the job finished first."""
        deadline = asyncio.get_running_loop().time() + 3 * HEARTBEAT_S
        while asyncio.get_running_loop().time() < deadline:
            state = await self.r.hget(key, "state")
            if state != "running":
                return state == "failed"
            await asyncio.sleep(POLL_S)
        return True  # the owner is slow to answer; its heartbeat will still cancel the job

    # answers ----------------------------------------------------------------------------------------------
    async def result(self, job: Job | RemoteJob, request_id: str | None) -> P.RolloutResponse:
        """The job's response once it is done; its error, if it failed."""
        if isinstance(job, RemoteJob):
            return await self._remote_result(job)
        job.waiters += 1
        try:
            await asyncio.wait({job.task})
        except asyncio.CancelledError:  # our caller went away
            job.waiters -= 1
            self._abandoned(job, request_id)
            raise
        job.waiters -= 1
        await self._failure_recorded(job, request_id)
        if job.task.cancelled():
            raise RolloutCancelled()
        return job.task.result()

    @staticmethod
    async def _failure_recorded(job: Job, request_id: str | None) -> None:
        """A job that failed (a 503 for a pause, say) or was cancelled: wait until its record says so, so that a
        retry its caller sends on the answer runs anew instead of finding the failed job."""
        if request_id and (job.task.cancelled() or job.task.exception() is not None):
            with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError from 3.11, its own class on 3.10
                await asyncio.wait_for(job.recorded.wait(), RECORD_WAIT_S)

    async def lines(self, job: Job | RemoteJob, request_id: str | None) -> AsyncIterator[str]:
        """NDJSON: a GroupEvent per finished group, then a StreamEnd (with the error's status if the job failed)."""
        if isinstance(job, RemoteJob):
            async for line in self._remote_lines(job):
                yield line
            return
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
            await self._failure_recorded(job, request_id)
            yield P.StreamEnd(groups=len(job.groups), error=error.message, status=error.status).model_dump_json() + "\n"

    async def _remote_result(self, job: RemoteJob) -> P.RolloutResponse:
        while True:
            record = await self._wait(job)
            if record["state"] == "done":
                return P.RolloutResponse.model_validate_json(record["result"])
            await asyncio.sleep(POLL_S)

    async def _remote_lines(self, job: RemoteJob) -> AsyncIterator[str]:
        sent = 0
        try:
            while True:
                record = await self._wait(job)
                for line in await self.r.lrange(f"{job.key}:groups", sent, -1):
                    sent += 1
                    yield line + "\n"
                if record["state"] == "done":
                    report = P.RolloutResponse.model_validate_json(record["result"]).filter
                    yield P.StreamEnd(groups=sent, filter=report).model_dump_json() + "\n"
                    return
                await asyncio.sleep(POLL_S)
        except ServiceError as error:
            yield P.StreamEnd(groups=sent, error=error.message, status=error.status).model_dump_json() + "\n"
        except RunAgain:
            error = "the replica running this request went away: send it again (the same request_id runs it anew)"
            yield P.StreamEnd(groups=sent, error=error, status=503).model_dump_json() + "\n"

    async def _wait(self, job: RemoteJob) -> dict:
        """The record as of now (telling its owner a caller waits); its error if it failed."""
        await self.r.set(f"{job.key}:waiting", 1, px=int(3000 * HEARTBEAT_S))
        record = await self.r.hgetall(job.key)
        if record.get("state") == "failed":
            error = ServiceError(record.get("error", "the rollout failed"))
            error.status = int(record.get("status", 500))
            error.retry_after_s = int(record.get("retry_after", 0)) or (1 if error.status == 429 else None)
            raise error
        if not record or (record.get("state") == "running" and not await self.r.exists(f"{job.key}:owner")):
            raise RunAgain()
        return record

    def _abandoned(self, job: Job, request_id: str | None) -> None:
        """A caller went away. With none left, the engine work is cancelled: at once without a request_id, else
        after FARM_DISCONNECT_GRACE_S unless a retry under the same id (a client whose read timed out) waits for it
        by then, on this replica or another."""
        if job.waiters > 0:
            return
        if not request_id or self.settings.disconnect_grace_s == 0:
            job.task.cancel()
            return

        async def after_grace():
            await asyncio.sleep(self.settings.disconnect_grace_s)
            while job.waiters == 0 and not job.task.done():
                if not await self.r.exists(f"{self.key(request_id)}:waiting"):
                    job.task.cancel()
                    return
                await asyncio.sleep(HEARTBEAT_S)

        self.spawn(after_grace())


def versioned(groups: list[P.Group]) -> list[P.Group]:
    """The groups with every sample's token_weight_versions filled in (one per token, even when they agree), for a
    trainer that recycles cut samples."""
    out = [g.model_copy(deep=True) for g in groups]  # the job's own stay as they are, for its record
    for g in out:
        for s in g.samples:
            if s.token_weight_versions is None:
                s.token_weight_versions = [s.weight_version] * len(s.token_ids)
    return out
