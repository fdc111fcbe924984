"""The pull-mode trajectory queue: generation ahead of the trainer, with leases and acks, kept in Redis so that it
survives an ingress restart and every ingress replica serves the same queue.

A source is a stream of prompts: a dataset in the repo (cycled), or prompts a client pushes. One ingress replica
at a time generates for a source (it holds the source's `owner` key; when it dies the key lapses and another
takes over), keeping `target_groups` groups ready. A pull leases groups; an ack settles them; a lease that runs
out makes its unacked groups deliverable again under the same item_id. A group older than a pull's
`max_staleness` is dropped and its prompt generated again; a late ack of it withdraws the regeneration.

The Redis keys and the scripts that settle entries are in rollout_farm/services/queue/store.py, the background
generation in rollout_farm/services/queue/generation.py, the gauges in rollout_farm/services/queue/gauges.py.

Sources are owned (docs/tenants.md): a tenant's token makes a source its own, and sees, feeds, pulls, acks and
removes only its own; another's is as unknown (404; an ack of its item ids answers them `unknown`). The admin token
sees and changes every source. Without a token, the list shows the sources the admin made (all of them, without
tenants: as before tenants); the other routes take a token.

Why a zset of deadlines and XCLAIM rather than XAUTOCLAIM: every pull sets its own lease_s, and XAUTOCLAIM
takes one min-idle time per call. Settling (ack, stale drop) runs as Lua scripts: each checks and changes the
entry in one step, so an ack racing a redelivery or a stale drop counts once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import NamedTuple

from redis.asyncio import Redis
from redis.exceptions import ResponseError, WatchError

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import Conflict, NotFound
from rollout_farm.services.observability import metrics
from rollout_farm.services.queue.gauges import GAUGES
from rollout_farm.services.queue.generation import QueueGeneration
from rollout_farm.services.queue.store import ACK, ADD, DROP, GROUP, Keys, prompt_entries
from rollout_farm.services.state.redis_client import Owner
from rollout_farm.services.tenants.registry import ADMIN, Principal

log = logging.getLogger("farm.queue")

POLL_S = 0.05  # a pull that waits for groups looks again this often


class Source(NamedTuple):
    spec: P.QueueSource
    nonce: str  # a source added again under its name gets a new one: the old item ids are unknown to it
    owner: str | None  # the tenant that added it; None: the admin


def visible(who: Principal, owner: str | None) -> bool:
    """Whether `who` sees (and, with a token, changes) a source of `owner`: the admin every source, a tenant its own,
    a caller without a token the admin's."""
    return who.admin or owner == who.tenant


class TrajectoryQueue(QueueGeneration):
    """The queue as this ingress replica sees it. `generate(request)` returns the groups of a RolloutRequest, and
    `generate_episodes(request)` those of an EpisodeRequest (an episode source's); `await version()` the committed
    version, read from the state (a push through another replica counts at once); `admitted(principal, samples)`
    counts a batch against its source owner's quota and fair share (Tenants.admitted)."""

    def __init__(self, r: Redis, prefix: str, generate, generate_episodes, version, batch_groups: int, admitted):
        self.r, self.prefix, self.generate, self.version, self.batch_groups = r, prefix, generate, version, batch_groups
        self.generate_episodes, self.admitted = generate_episodes, admitted
        self.sources_key = f"{prefix}:q:sources"  # name -> {"spec": QueueSource, "nonce": ...}
        self.owner = Owner(r)
        self.consumer = f"ingress-{self.owner.me[:12]}"
        self.running: dict[str, asyncio.Task] = {}  # sources this replica generates for
        self.cursors: dict[str, tuple] = {}  # source -> (prompts drawn, the dataset's iterator from there)
        self.snapshot: list[P.QueueSourceState] = []  # for the gauges, refreshed by states()
        self._ack, self._drop, self._add = r.register_script(ACK), r.register_script(DROP), r.register_script(ADD)
        GAUGES.queues.add(self)

    # sources ----------------------------------------------------------------------------------------------
    async def _source(self, name: str) -> Source | None:
        raw = await self.r.hget(self.sources_key, name)
        if raw is None:
            return None
        entry = json.loads(raw)
        return Source(P.QueueSource.model_validate(entry["spec"]), entry["nonce"], entry.get("owner"))

    async def get(self, name: str, who: Principal = ADMIN) -> Source:
        """The source, when `who` may see it; 404 otherwise (another tenant's is as unknown as none)."""
        found = await self._source(name)
        if found is None or not visible(who, found.owner):
            names = await self._names(who)
            raise NotFound(
                f"no queue source {name!r}; registered: {', '.join(names) or 'none'} (POST /v1/queue/sources)",
                [{"field": "source", "message": "unknown"}],
            )
        return found

    async def _names(self, who: Principal) -> list[str]:
        """The names of the sources `who` may see."""
        entries = await self.r.hgetall(self.sources_key)
        return sorted(n for n, raw in entries.items() if visible(who, json.loads(raw).get("owner")))

    async def add_source(self, spec: P.QueueSource, who: Principal = ADMIN) -> P.QueueSourceState:
        """A new source, owned by `who`'s tenant (the admin's: none)."""
        k = Keys(self.prefix, spec.name)
        made = {"spec": spec.model_dump(mode="json"), "nonce": uuid.uuid4().hex[:8], "owner": who.tenant}
        entry = json.dumps(made)
        async with self.r.pipeline(transaction=True) as pipe:
            await pipe.watch(self.sources_key)
            if (held := await pipe.hget(self.sources_key, spec.name)) is not None:
                if not visible(who, json.loads(held).get("owner")):  # another tenant's: nothing told about it
                    raise Conflict(f"the source name {spec.name!r} is taken: pick another name")
                raise Conflict(
                    f"source {spec.name!r} exists: DELETE /v1/queue/sources/{spec.name} first, or pick another name"
                )
            pipe.multi()
            pipe.delete(*k.all())
            pipe.hset(self.sources_key, spec.name, entry)
            pipe.xgroup_create(k.ready, GROUP, id="$", mkstream=True)
            if spec.prompts:
                pipe.rpush(k.pending, *prompt_entries(spec.prompts, len(spec.prompts)))
                pipe.hset(k.stats, "pids", len(spec.prompts))
            try:
                await pipe.execute()
            except WatchError:
                raise Conflict(f"source {spec.name!r} was added or removed meanwhile: send the request again") from None
        metrics.init_source(spec.name)
        log.info(
            "queue_source_added", extra={"source": spec.name, "dataset": spec.dataset, "prompts": len(spec.prompts)}
        )
        return await self.state(spec.name)

    async def add_prompts(
        self, name: str, prompts: list[P.Prompt], batch_id: str | None = None, who: Principal = ADMIN
    ) -> P.QueueSourceState:
        """Queue prompts at the back; with a batch_id, only the first addition of that id counts (a retry or a
        resumed trainer adding its step's prompts again adds nothing)."""
        await self.get(name, who)
        k = Keys(self.prefix, name)
        prompt_json = [json.dumps(p.model_dump(mode="json")) for p in prompts]
        await self._add(keys=[k.pending, k.batches, k.stats], args=[batch_id or "", *prompt_json])
        return await self.state(name)

    async def remove(self, name: str, who: Principal = ADMIN) -> P.QueueSourceState:
        state = await self.state(name, who)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hdel(self.sources_key, name)
            pipe.delete(*Keys(self.prefix, name).all())
            await pipe.execute()
        if task := self.running.pop(name, None):
            task.cancel()
        return state

    async def state(self, name: str, who: Principal = ADMIN) -> P.QueueSourceState:
        spec = (await self.get(name, who)).spec
        k = Keys(self.prefix, name)
        now = await self._now_ms()
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.llen(k.pending).llen(k.generating).xlen(k.ready).zcount(k.leases, "-inf", now).scard(k.acked)
            pipe.hgetall(k.stats).xpending(k.ready, GROUP)
            pending, generating, length, expired, acked, stats, pel = await pipe.execute()
        in_pel = pel["pending"] if isinstance(pel, dict) else 0
        return P.QueueSourceState(
            name=name,
            dataset=spec.dataset,
            pending_prompts=pending,
            ready=length - in_pel + expired,  # leases that ran out count as ready: the next pull takes them
            leased=in_pel - expired,
            acked=acked,
            redelivered=int(stats.get("redelivered", 0)),
            stale_dropped=int(stats.get("stale_dropped", 0)),
            generating=generating > 0,
            error=stats.get("error") or None,
            target_groups=spec.target_groups,
            generation_busy_s=round(float(stats.get("busy_s", 0.0)), 3),
            generation_idle_s=round(float(stats.get("idle_s", 0.0)), 3),
        )

    async def states(self, who: Principal = ADMIN) -> list[P.QueueSourceState]:
        """The sources `who` may see (the gauges keep the admin's view: every source)."""
        out = []
        for name in await self._names(who):
            try:
                out.append(await self.state(name))
                metrics.init_source(name)  # sources added through another replica, or before a restart
            except NotFound:  # removed meanwhile
                pass
        if who.admin:
            self.snapshot = out
        return out

    async def _now_ms(self) -> int:
        seconds, micros = await self.r.time()
        return seconds * 1000 + micros // 1000

    # pulls and acks -------------------------------------------------------------------------------------
    async def pull(self, req: P.PullRequest, who: Principal = ADMIN) -> P.PullResponse:
        """Lease groups of `req.source`, one `who` may see (404 otherwise: never another tenant's groups)."""
        nonce = (await self.get(req.source, who)).nonce
        k = Keys(self.prefix, req.source)
        deadline = await self._now_ms() + int(req.wait_s * 1000)
        taken, dropped = [], 0
        while True:
            current = await self.version()
            entries = await self._claim_expired(k, req.max_groups - len(taken))
            first = await self._read_new(k, req.max_groups - len(taken) - len(entries))
            withdrawn = await self.r.smembers(k.withdrawn) if first else set()
            for entry_id, fields, is_new in [(i, f, False) for i, f in entries] + [(i, f, True) for i, f in first]:
                version, prompt_entry = int(fields["version"]), fields["entry"]
                pid = str(json.loads(prompt_entry)["pid"])
                item_id = f"{req.source}:{nonce}:{entry_id}"
                how = None
                if is_new and pid in withdrawn:
                    how = "withdrawn"
                elif req.max_staleness is not None and current - version > req.max_staleness:
                    how = "fresh" if is_new else "delivered"  # a delivered one's late ack withdraws the new one
                if how is None:
                    taken.append((entry_id, item_id, fields))
                    continue
                keys = [k.ready, k.leases, k.deliveries, k.pending, k.dropped, k.stats, k.withdrawn]
                if await self._drop(keys=keys, args=[entry_id, item_id, prompt_entry, how, pid]) and how != "withdrawn":
                    dropped += 1
            now = await self._now_ms()
            if taken or now >= deadline:
                break
            await asyncio.sleep(min(POLL_S, (deadline - now) / 1000))
        items = await self._lease(k, taken, now + int(req.lease_s * 1000))
        metrics.record_staleness([item.group for item in items], current)
        redelivered = sum(i.deliveries > 1 for i in items)
        if redelivered:
            await self.r.hincrby(k.stats, "redelivered", redelivered)
        metrics.QUEUE_REDELIVERED.labels(req.source).inc(redelivered)
        metrics.QUEUE_STALE.labels(req.source).inc(dropped)
        return P.PullResponse(
            lease_id=uuid.uuid4().hex,
            lease_expires_s=req.lease_s,
            current_version=current,
            items=items,
            stale_dropped=dropped,
        )

    async def _claim_expired(self, k: Keys, n: int) -> list[tuple[str, dict]]:
        """Entries whose lease ran out, delivered to this pull (ZREM decides which of two racing pulls gets one)."""
        if n <= 0:
            return []
        out = []
        for entry_id in await self.r.zrangebyscore(k.leases, "-inf", await self._now_ms(), start=0, num=n):
            if await self.r.zrem(k.leases, entry_id):
                for claimed_id, fields in await self.r.xclaim(k.ready, GROUP, self.consumer, 0, [entry_id]):
                    if fields:  # gone if it was acked meanwhile
                        out.append((claimed_id, fields))
        return out

    async def _read_new(self, k: Keys, n: int) -> list[tuple[str, dict]]:
        if n <= 0:
            return []
        try:
            answer = await self.r.xreadgroup(GROUP, self.consumer, {k.ready: ">"}, count=n)
        except ResponseError as e:  # NOGROUP: the source was removed meanwhile
            raise NotFound(f"queue source {k.ready} was removed: {e}") from None
        return [(entry_id, fields) for _, entries in answer for entry_id, fields in entries if fields]

    async def _lease(self, k: Keys, taken, deadline_ms: int) -> list[P.QueueItem]:
        if not taken:
            return []
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.zadd(k.leases, {entry_id: deadline_ms for entry_id, _, _ in taken})
            for entry_id, _, _ in taken:
                pipe.hincrby(k.deliveries, entry_id, 1)
            deliveries = (await pipe.execute())[1:]
        items = []
        for (_, item_id, fields), times in zip(taken, deliveries):
            item = json.loads(fields["item"])
            items.append(
                P.QueueItem(
                    item_id=item_id,
                    prompt=item["prompt"],
                    group=item["group"],
                    weight_version=int(fields["version"]),
                    deliveries=times,
                )
            )
        return items

    async def ack(self, item_ids: list[str], who: Principal = ADMIN) -> P.AckResponse:
        """Settle delivered groups, whatever their lease state; acking again changes nothing. The items of a source
        `who` may not see are `unknown`, and stay as they are."""
        acked, already, unknown = [], [], []
        nonces: dict[str, str | None] = {}
        for item_id in item_ids:
            name, nonce, entry_id = (item_id.split(":") + ["", ""])[:3]
            if name not in nonces:
                found = await self._source(name) if name else None
                nonces[name] = found.nonce if found and visible(who, found.owner) else None
            if nonces[name] is None or nonce != nonces[name] or not entry_id:
                unknown.append(item_id)
                continue
            k = Keys(self.prefix, name)
            keys = [k.ready, k.leases, k.deliveries, k.acked, k.dropped, k.pending, k.withdrawn, k.settled]
            try:
                outcome = await self._ack(keys=keys, args=[item_id, entry_id])
            except ResponseError:  # not a stream entry id
                outcome = 0
            if outcome == 1:
                metrics.QUEUE_ACKED.labels(name).inc()
            (unknown, acked, already)[outcome].append(item_id)
        return P.AckResponse(acked=acked, already_acked=already, unknown=unknown)
