"""The pull-mode trajectory queue: generation ahead of the trainer, with leases and acks.

A source is a stream of prompts: a dataset in the repo (cycled), or prompts a client pushes
(as JSON or an uploaded JSONL file). For each source a background task keeps `target_groups`
groups ready. A pull leases groups; an ack settles them; a lease that runs out puts its
unacked groups back at the front, to be delivered again under the same item_id. A group
older than a pull's `max_staleness` is dropped and its prompt generated again.

So nothing is lost (every prompt ends in an acked group or is still queued), and a trainer
that skips item_ids it has already used never trains on a duplicate. Acks are idempotent.
State lives in the ingress process: an ingress restart starts the queue empty.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily

from services import metrics
from services import protocol as P
from services.errors import Conflict, NotFound
from services.tasks import TASKS

log = logging.getLogger("farm.queue")


@dataclass
class Item:
    item_id: str
    prompt: P.Prompt
    group: P.Group
    weight_version: int
    deliveries: int = 0
    lease: str | None = None
    deadline: float = 0.0

    def wire(self) -> P.QueueItem:
        return P.QueueItem(
            item_id=self.item_id,
            prompt=self.prompt,
            group=self.group,
            weight_version=self.weight_version,
            deliveries=self.deliveries,
        )


class Source:
    def __init__(self, spec: P.QueueSource):
        self.spec = spec
        self.pending: deque[P.Prompt] = deque(spec.prompts)  # prompts to generate; stale ones come back to the front
        self.endless = self._dataset_prompts(spec) if spec.dataset else None
        self.ready: deque[Item] = deque()
        self.leased: dict[str, Item] = {}
        self.delivered: set[str] = set()  # delivered and not yet acked
        self.acked: set[str] = set()
        # ids never repeat, even for a source added again
        self.seq, self.nonce = itertools.count(), uuid.uuid4().hex[:8]
        # delivered, then dropped as stale: a late ack withdraws the regeneration
        self.dropped: dict[str, P.Prompt] = {}
        self.withdrawn: list[P.Prompt] = []
        self.redelivered = self.stale_dropped = 0
        self.generating, self.error = False, None
        self.wake = asyncio.Event()  # new prompts, or fewer ready groups than the target
        self.changed = asyncio.Event()  # new ready groups, for pulls that wait
        self.task: asyncio.Task | None = None

    @staticmethod
    def _dataset_prompts(spec: P.QueueSource):
        task = TASKS.get(spec.dataset)()
        rng = random.Random(spec.seed)
        while True:
            for problem in task.train_batch(rng, 64):
                yield P.Prompt(text=problem.prompt, ground_truth=problem.answer)

    def take(self, k: int) -> list[P.Prompt]:
        out = [self.pending.popleft() for _ in range(min(k, len(self.pending)))]
        if self.endless is not None:
            out += [next(self.endless) for _ in range(k - len(out))]
        return out

    def withdraw(self, prompt: P.Prompt) -> None:
        """Take back the regeneration of a prompt whose stale group was acked after all (unless already delivered)."""
        if any(p is prompt for p in self.pending):
            self.pending = deque(p for p in self.pending if p is not prompt)
        elif any(i.prompt is prompt and i.deliveries == 0 for i in self.ready):
            self.ready = deque(i for i in self.ready if not (i.prompt is prompt and i.deliveries == 0))
        else:  # being generated now: dropped when it lands
            self.withdrawn.append(prompt)

    def expire(self, now: float) -> None:
        """Unacked groups whose lease ran out go back to the front, to be delivered again."""
        for item in [i for i in self.leased.values() if i.deadline <= now]:
            del self.leased[item.item_id]
            item.lease = None
            self.ready.appendleft(item)

    def signal(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def state(self) -> P.QueueSourceState:
        """The counts as of now; leases that ran out count as ready (they move there at the next pull)."""
        now = time.monotonic()
        expired = sum(i.deadline <= now for i in self.leased.values())
        return P.QueueSourceState(
            name=self.spec.name,
            dataset=self.spec.dataset,
            pending_prompts=len(self.pending),
            ready=len(self.ready) + expired,
            leased=len(self.leased) - expired,
            acked=len(self.acked),
            redelivered=self.redelivered,
            stale_dropped=self.stale_dropped,
            generating=self.generating,
            error=self.error,
        )


class TrajectoryQueue:
    """The sources of one ingress. `generate(request)` returns the groups of a RolloutRequest; `version()` the
    committed version."""

    def __init__(self, generate, version, batch_groups: int):
        self.generate, self.version, self.batch_groups = generate, version, batch_groups
        self.sources: dict[str, Source] = {}
        GAUGES.queues.add(self)

    def add_source(self, spec: P.QueueSource) -> P.QueueSourceState:
        if spec.name in self.sources:
            raise Conflict(
                f"source {spec.name!r} exists: DELETE /v1/queue/sources/{spec.name} first, or pick another name"
            )
        src = self.sources[spec.name] = Source(spec)
        src.task = asyncio.create_task(self._run(src))
        log.info(
            "queue_source_added", extra={"source": spec.name, "dataset": spec.dataset, "prompts": len(spec.prompts)}
        )
        return src.state()

    def add_prompts(self, name: str, prompts: list[P.Prompt]) -> P.QueueSourceState:
        src = self.get(name)
        src.pending.extend(prompts)
        src.wake.set()
        return src.state()

    def remove(self, name: str) -> P.QueueSourceState:
        src = self.get(name)
        src.task.cancel()
        del self.sources[name]
        return src.state()

    def get(self, name: str) -> Source:
        if name not in self.sources:
            raise NotFound(
                f"no queue source {name!r}; registered: {', '.join(self.sources) or 'none'} (POST /v1/queue/sources)"
            )
        return self.sources[name]

    def states(self) -> list[P.QueueSourceState]:
        return [src.state() for src in self.sources.values()]

    async def _run(self, src: Source) -> None:
        """Keep target_groups groups ready, a batch at a time."""
        spec, batch = src.spec, 0
        while True:
            src.expire(time.monotonic())  # groups whose lease ran out are ready again: they count towards the target
            need = spec.target_groups - len(src.ready)
            prompts = src.take(min(need, self.batch_groups)) if need > 0 else []
            if not prompts:
                src.wake.clear()
                await src.wake.wait()
                continue
            params = (
                spec.sampling_params
                if spec.sampling_params.seed is None
                else spec.sampling_params.model_copy(update={"seed": (spec.sampling_params.seed + batch) % 2**63})
            )
            reward = spec.reward or (TASKS.get(spec.dataset).reward if spec.dataset else None)
            req = P.RolloutRequest(
                prompts=prompts, n=spec.n, sampling_params=params, sampler=spec.sampler, reward=reward
            )
            src.generating, batch = True, batch + 1
            try:
                groups = await self.generate(req)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the prompts wait at the front; try again shortly
                src.pending.extendleft(reversed(prompts))
                src.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                log.warning("queue_generate_failed", extra={"source": spec.name, "error": src.error})
                await asyncio.sleep(1.0)
                continue
            finally:
                src.generating = False
            src.error = None
            # a filtering sampler returns only some
            for prompt, group in ((prompts[g.prompt_index], g) for g in groups):
                if any(p is prompt for p in src.withdrawn):
                    src.withdrawn = [p for p in src.withdrawn if p is not prompt]
                    continue
                version = min(
                    (min(s.token_weight_versions or [s.weight_version]) for s in group.samples), default=self.version()
                )
                src.ready.append(Item(f"{spec.name}:{src.nonce}:{next(src.seq)}", prompt, group, version))
            metrics.QUEUE_GENERATED.labels(spec.name).inc(len(groups))
            src.signal()

    async def pull(self, req: P.PullRequest) -> P.PullResponse:
        src = self.get(req.source)
        deadline = time.monotonic() + req.wait_s
        taken, dropped, current = [], 0, self.version()
        while True:
            now = time.monotonic()
            src.expire(now)
            current = self.version()
            while src.ready and len(taken) < req.max_groups:
                item = src.ready.popleft()
                if req.max_staleness is not None and current - item.weight_version > req.max_staleness:
                    src.pending.appendleft(item.prompt)  # generated again, on newer weights
                    if item.deliveries:  # its lease ran out: a late ack still counts, and withdraws the new one
                        src.dropped[item.item_id] = item.prompt
                    dropped += 1
                    continue
                taken.append(item)
            if dropped:
                src.wake.set()
            if taken or now >= deadline:
                break
            changed = src.changed
            src.wake.set()
            try:
                await asyncio.wait_for(changed.wait(), deadline - now)
            except asyncio.TimeoutError:
                pass
        lease, expires = uuid.uuid4().hex, time.monotonic() + req.lease_s
        for item in taken:
            item.deliveries += 1
            item.lease, item.deadline = lease, expires
            src.leased[item.item_id] = item
            src.delivered.add(item.item_id)
            for s in item.group.samples:
                metrics.STALENESS.observe(max(0, current - s.weight_version))
        redelivered = sum(item.deliveries > 1 for item in taken)
        src.redelivered += redelivered
        src.stale_dropped += dropped
        metrics.QUEUE_REDELIVERED.labels(src.spec.name).inc(redelivered)
        metrics.QUEUE_STALE.labels(src.spec.name).inc(dropped)
        if len(src.ready) < src.spec.target_groups:
            src.wake.set()
        return P.PullResponse(
            lease_id=lease,
            lease_expires_s=req.lease_s,
            current_version=current,
            items=[i.wire() for i in taken],
            stale_dropped=dropped,
        )

    def ack(self, item_ids: list[str]) -> P.AckResponse:
        """Settle delivered groups, whatever their lease state; acking again changes nothing."""
        acked, already, unknown = [], [], []
        for item_id in item_ids:
            src = self.sources.get(item_id.split(":", 1)[0])
            if src is None or (item_id not in src.delivered and item_id not in src.acked):
                unknown.append(item_id)
            elif item_id in src.acked:
                already.append(item_id)
            else:
                src.delivered.discard(item_id)
                src.acked.add(item_id)
                if src.leased.pop(item_id, None) is None:  # its lease ran out: it may wait for redelivery ...
                    src.ready = deque(i for i in src.ready if i.item_id != item_id)
                    # ... or was dropped as stale: withdraw its regeneration
                    if (prompt := src.dropped.pop(item_id, None)) is not None:
                        src.withdraw(prompt)
                    src.wake.set()
                metrics.QUEUE_ACKED.labels(src.spec.name).inc()
                acked.append(item_id)
        return P.AckResponse(acked=acked, already_acked=already, unknown=unknown)


class QueueGauges:
    """farm_queue_ready_groups and farm_queue_leased_groups per source, read from the queues at scrape time."""

    def __init__(self):
        self.queues: weakref.WeakSet[TrajectoryQueue] = weakref.WeakSet()

    def collect(self):
        ready = GaugeMetricFamily(
            "farm_queue_ready_groups", "Queue depth: generated groups waiting to be pulled", labels=["source"]
        )
        leased = GaugeMetricFamily(
            "farm_queue_leased_groups", "Outstanding leases: pulled groups not yet acked", labels=["source"]
        )
        for queue in self.queues:
            for s in queue.states():
                ready.add_metric([s.name], s.ready)
                leased.add_metric([s.name], s.leased)
        return [ready, leased]


GAUGES = QueueGauges()
REGISTRY.register(GAUGES)
