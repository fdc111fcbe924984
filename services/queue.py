"""The pull-mode trajectory queue: generation ahead of the trainer, with leases and acks, kept in Redis so that it
survives an ingress restart and every ingress replica serves the same queue.

A source is a stream of prompts: a dataset in the repo (cycled), or prompts a client pushes. One ingress replica
at a time generates for a source (it holds the source's `owner` key; when it dies the key lapses and another
takes over), keeping `target_groups` groups ready. A pull leases groups; an ack settles them; a lease that runs
out makes its unacked groups deliverable again under the same item_id. A group older than a pull's
`max_staleness` is dropped and its prompt generated again; a late ack of it withdraws the regeneration.

Keys of a source, under farm:<app>:q:<name>:
  pending     list: prompts to generate, each JSON {"pid", "prompt"}; stale groups' prompts return to the front
  generating  list: prompts the owner is generating now; back to the front of pending if the owner dies
  ready       stream, one entry per group, read by the consumer group "trainers": XREADGROUP delivers an entry
              (it joins the group's pending entries list, the PEL), XACK settles it, XCLAIM delivers it again
  leases      zset: entry id -> lease deadline (ms, Redis clock)
  deliveries  hash: entry id -> times delivered
  acked       set: acked item_ids (acking again changes nothing)
  dropped     hash: item_id -> prompt JSON, for delivered groups later dropped as stale
  withdrawn   set: pids whose regeneration a late ack withdrew (skipped when they land or are first pulled)
  stats       hash: redelivered, stale_dropped, error; drawn (dataset prompts taken so far); pids (last pid)
  batches     set: the batch_ids of prompt additions (a repeated addition with the same batch_id adds nothing)
  settled     hash: pid -> groups of that prompt acked (1 each; bench/chaos.py audits it)
  owner       the generating replica's claim (services/state.py Owner)

Why a zset of deadlines and XCLAIM rather than XAUTOCLAIM: every pull sets its own lease_s, and XAUTOCLAIM
takes one min-idle time per call. Settling (ack, stale drop) runs as Lua scripts: each checks and changes the
entry in one step, so an ack racing a redelivery or a stale drop counts once.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import uuid
import weakref

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from redis.asyncio import Redis
from redis.exceptions import ResponseError, WatchError

from services import metrics
from services import protocol as P
from services.errors import Conflict, NotFound
from services.state import Owner
from services.tasks import TASKS

log = logging.getLogger("farm.queue")

GROUP = "trainers"
POLL_S = 0.05  # a pull that waits for groups looks again this often
IDLE_S = 0.2  # an owner with nothing to generate looks again this often
SUPERVISE_S = 0.5  # how often a replica looks for sources nobody generates for
ORPHAN_IDLE_MS = 30_000  # a delivered entry with no lease (its ingress died between the two) gets one after this

ACK = """
if redis.call('sismember', KEYS[4], ARGV[1]) == 1 then return 2 end
local entry = redis.call('xrange', KEYS[1], ARGV[2], ARGV[2])[1]
if entry and redis.call('xack', KEYS[1], 'trainers', ARGV[2]) == 1 then
  local fields, pid = entry[2], nil
  for i = 1, #fields, 2 do if fields[i] == 'entry' then pid = cjson.decode(fields[i + 1])['pid'] end end
  redis.call('xdel', KEYS[1], ARGV[2]); redis.call('zrem', KEYS[2], ARGV[2]); redis.call('hdel', KEYS[3], ARGV[2])
  redis.call('sadd', KEYS[4], ARGV[1]); redis.call('hincrby', KEYS[8], tostring(pid), 1); return 1
end
local prompt = redis.call('hget', KEYS[5], ARGV[1])
if prompt then
  local pid = tostring(cjson.decode(prompt)['pid'])
  redis.call('hdel', KEYS[5], ARGV[1]); redis.call('sadd', KEYS[4], ARGV[1]); redis.call('hincrby', KEYS[8], pid, 1)
  if redis.call('lrem', KEYS[6], 1, prompt) == 0 then redis.call('sadd', KEYS[7], pid) end
  return 1
end
return 0
"""  # KEYS: ready leases deliveries acked dropped pending withdrawn settled; ARGV: item_id entry_id -> 1, 2 again, 0

DROP = """
if redis.call('xack', KEYS[1], 'trainers', ARGV[1]) == 0 then return 0 end
redis.call('xdel', KEYS[1], ARGV[1]); redis.call('zrem', KEYS[2], ARGV[1]); redis.call('hdel', KEYS[3], ARGV[1])
if ARGV[4] == 'withdrawn' then redis.call('srem', KEYS[7], ARGV[5]); return 1 end
redis.call('lpush', KEYS[4], ARGV[3])
if ARGV[4] == 'delivered' then redis.call('hset', KEYS[5], ARGV[2], ARGV[3]) end
redis.call('hincrby', KEYS[6], 'stale_dropped', 1)
return 1
"""  # KEYS: ready leases deliveries pending dropped stats withdrawn; ARGV: entry_id item_id prompt how pid


ADD = """
if ARGV[1] ~= '' and redis.call('sadd', KEYS[2], ARGV[1]) == 0 then return 0 end
local last = redis.call('hincrby', KEYS[3], 'pids', #ARGV - 1)
for i = 2, #ARGV do
  redis.call('rpush', KEYS[1], '{"pid": ' .. (last - #ARGV + i) .. ', "prompt": ' .. ARGV[i] .. '}')
end
return 1
"""  # KEYS: pending batches stats; ARGV: batch_id ('' for none), each prompt's JSON -> 0 when the batch came before
# (the entries are what prompt_entries() writes; pids are taken here, so a batch added before takes none)


class Keys:
    def __init__(self, prefix: str, name: str):
        base = f"{prefix}:q:{name}"
        self.pending, self.generating, self.ready = f"{base}:pending", f"{base}:generating", f"{base}:ready"
        self.leases, self.deliveries, self.acked = f"{base}:leases", f"{base}:deliveries", f"{base}:acked"
        self.dropped, self.withdrawn, self.stats = f"{base}:dropped", f"{base}:withdrawn", f"{base}:stats"
        self.owner, self.batches, self.settled = f"{base}:owner", f"{base}:batches", f"{base}:settled"

    def all(self) -> list[str]:
        return list(vars(self).values())


def dataset_prompts(spec: P.QueueSource, skip: int):
    """The dataset's prompts in the source's order, from the `skip`-th on (endless)."""
    task, rng = TASKS.get(spec.dataset)(), random.Random(spec.seed)
    endless = (p for _ in itertools.count() for p in task.train_batch(rng, 64))
    for problem in itertools.islice(endless, skip, None):
        yield P.Prompt(text=problem.prompt, ground_truth=problem.answer)


def prompt_entries(prompts: list[P.Prompt], last_pid: int) -> list[str]:
    """The JSON entries of prompts whose pids end at last_pid (a pid tells a prompt's generations apart)."""
    first = last_pid - len(prompts) + 1
    return [json.dumps({"pid": first + i, "prompt": p.model_dump(mode="json")}) for i, p in enumerate(prompts)]


def oldest_version(group: P.Group, default: int) -> int:
    return min((min(s.token_weight_versions or [s.weight_version]) for s in group.samples), default=default)


class TrajectoryQueue:
    """The queue as this ingress replica sees it. `generate(request)` returns the groups of a RolloutRequest;
    `await version()` the committed version, read from the state (a push through another replica counts at once)."""

    def __init__(self, r: Redis, prefix: str, generate, version, batch_groups: int):
        self.r, self.prefix, self.generate, self.version, self.batch_groups = r, prefix, generate, version, batch_groups
        self.sources_key = f"{prefix}:q:sources"  # name -> {"spec": QueueSource, "nonce": ...}
        self.owner = Owner(r)
        self.consumer = f"ingress-{self.owner.me[:12]}"
        self.running: dict[str, asyncio.Task] = {}  # sources this replica generates for
        self.cursors: dict[str, tuple] = {}  # source -> (prompts drawn, the dataset's iterator from there)
        self.snapshot: list[P.QueueSourceState] = []  # for the gauges, refreshed by states()
        self._ack, self._drop, self._add = r.register_script(ACK), r.register_script(DROP), r.register_script(ADD)
        GAUGES.queues.add(self)

    # sources ----------------------------------------------------------------------------------------------
    async def _source(self, name: str) -> tuple[P.QueueSource, str] | None:
        raw = await self.r.hget(self.sources_key, name)
        if raw is None:
            return None
        entry = json.loads(raw)
        return P.QueueSource.model_validate(entry["spec"]), entry["nonce"]

    async def get(self, name: str) -> tuple[P.QueueSource, str]:
        found = await self._source(name)
        if found is None:
            names = sorted(await self.r.hkeys(self.sources_key))
            raise NotFound(
                f"no queue source {name!r}; registered: {', '.join(names) or 'none'} (POST /v1/queue/sources)"
            )
        return found

    async def add_source(self, spec: P.QueueSource) -> P.QueueSourceState:
        k = Keys(self.prefix, spec.name)
        entry = json.dumps({"spec": spec.model_dump(mode="json"), "nonce": uuid.uuid4().hex[:8]})
        async with self.r.pipeline(transaction=True) as pipe:
            await pipe.watch(self.sources_key)
            if await pipe.hexists(self.sources_key, spec.name):
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
        log.info(
            "queue_source_added", extra={"source": spec.name, "dataset": spec.dataset, "prompts": len(spec.prompts)}
        )
        return await self.state(spec.name)

    async def add_prompts(self, name: str, prompts: list[P.Prompt], batch_id: str | None = None) -> P.QueueSourceState:
        """Queue prompts at the back; with a batch_id, only the first addition of that id counts (a retry or a
        resumed trainer adding its step's prompts again adds nothing)."""
        await self.get(name)
        k = Keys(self.prefix, name)
        prompt_json = [json.dumps(p.model_dump(mode="json")) for p in prompts]
        await self._add(keys=[k.pending, k.batches, k.stats], args=[batch_id or "", *prompt_json])
        return await self.state(name)

    async def remove(self, name: str) -> P.QueueSourceState:
        state = await self.state(name)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hdel(self.sources_key, name)
            pipe.delete(*Keys(self.prefix, name).all())
            await pipe.execute()
        if task := self.running.pop(name, None):
            task.cancel()
        return state

    async def state(self, name: str) -> P.QueueSourceState:
        spec, _ = await self.get(name)
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
        )

    async def states(self) -> list[P.QueueSourceState]:
        out = []
        for name in sorted(await self.r.hkeys(self.sources_key)):
            try:
                out.append(await self.state(name))
            except NotFound:  # removed meanwhile
                pass
        self.snapshot = out
        return out

    async def _now_ms(self) -> int:
        seconds, micros = await self.r.time()
        return seconds * 1000 + micros // 1000

    # generation -----------------------------------------------------------------------------------------
    async def supervise(self) -> None:
        """Claim the sources nobody generates for (new ones, and those of a replica that died), forever."""
        while True:
            try:
                for name in await self.r.hkeys(self.sources_key):
                    if name in self.running and not self.running[name].done():
                        continue
                    k = Keys(self.prefix, name)
                    if await self.owner.claim(k.owner):
                        await self._recover(k)
                        self.running[name] = asyncio.create_task(self._generate_for(name))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: try again
                log.warning("queue_supervise_failed", extra={"error": repr(e)})
            await asyncio.sleep(SUPERVISE_S)

    async def _recover(self, k: Keys) -> None:
        """What a previous owner was generating goes back to the front of pending, in order."""
        moved = 0
        while await self.r.lmove(k.generating, k.pending, "RIGHT", "LEFT") is not None:
            moved += 1
        if moved:
            log.warning("queue_generation_recovered", extra={"source": k.owner, "prompts": moved})

    async def _generate_for(self, name: str) -> None:
        """While this replica owns the source: keep target_groups groups ready, a batch at a time."""
        k, batch = Keys(self.prefix, name), 0
        keepalive = asyncio.create_task(self._keep_owning(k))
        try:
            while not keepalive.done():
                found = await self._source(name)
                if found is None:
                    return
                spec, nonce = found
                await self._lease_orphans(k)
                state = await self.state(name)
                need = spec.target_groups - state.ready
                taken = await self._take(k, spec, min(need, self.batch_groups)) if need > 0 else []
                if not taken:
                    await asyncio.sleep(IDLE_S)
                    continue
                batch += 1
                await self._generate_batch(k, spec, nonce, taken, batch)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("queue_owner_stopped", extra={"source": name, "error": repr(e)})
        finally:
            keepalive.cancel()
            await asyncio.shield(self._let_go(k))

    async def _keep_owning(self, k: Keys) -> None:
        while await self.owner.extend(k.owner):
            await asyncio.sleep(self.owner.ttl_ms / 5000)

    async def _let_go(self, k: Keys) -> None:
        try:
            await self.owner.release(k.owner)
        except Exception:  # it lapses by itself
            pass

    async def _take(self, k: Keys, spec: P.QueueSource, n: int) -> list[tuple[str, P.Prompt]]:
        """Up to n prompts moved from pending to generating (a dataset source draws more when pending runs out);
        each as (its JSON entry, the prompt)."""
        entries = []
        for _ in range(n):
            entry = await self.r.lmove(k.pending, k.generating, "LEFT", "RIGHT")
            if entry is None:
                break
            entries.append(entry)
        if spec.dataset and len(entries) < n:
            drawn = int(await self.r.hget(k.stats, "drawn") or 0)
            at, prompts = self.cursors.get(spec.name, (-1, None))
            if at != drawn:  # another replica drew before, or this one just took the source over
                prompts = dataset_prompts(spec, drawn)
            fresh = list(itertools.islice(prompts, n - len(entries)))
            self.cursors[spec.name] = (drawn + len(fresh), prompts)
            more = prompt_entries(fresh, await self.r.hincrby(k.stats, "pids", len(fresh)))
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.rpush(k.generating, *more).hincrby(k.stats, "drawn", len(fresh))
                await pipe.execute()
            entries += more
        return [(e, P.Prompt.model_validate(json.loads(e)["prompt"])) for e in entries]

    async def _generate_batch(self, k: Keys, spec: P.QueueSource, nonce: str, taken, batch: int) -> None:
        params = (
            spec.sampling_params
            if spec.sampling_params.seed is None
            else spec.sampling_params.model_copy(update={"seed": (spec.sampling_params.seed + batch) % 2**63})
        )
        reward = spec.reward or (TASKS.get(spec.dataset).reward if spec.dataset else None)
        req = P.RolloutRequest(
            prompts=[p for _, p in taken], n=spec.n, sampling_params=params, sampler=spec.sampler, reward=reward
        )
        try:
            groups = await self.generate(req)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the prompts wait at the front; try again shortly
            await self._recover(k)
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            await self.r.hset(k.stats, "error", error)
            log.warning("queue_generate_failed", extra={"source": spec.name, "error": error})
            await asyncio.sleep(1.0)
            return
        landed = [(taken[g.prompt_index], g) for g in groups]  # a filtering sampler returns only some
        await self._land(k, spec.name, nonce, landed)
        metrics.QUEUE_GENERATED.labels(spec.name).inc(len(landed))

    async def _land(self, k: Keys, name: str, nonce: str, landed) -> None:
        """The groups into the ready stream and the batch out of generating, in one transaction, if this replica
        still owns the source (else the new owner generates them again) and it was not removed meanwhile."""
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(k.owner, k.withdrawn, self.sources_key)
                    raw = await pipe.hget(self.sources_key, name)
                    if await pipe.get(k.owner) != self.owner.me or raw is None or json.loads(raw)["nonce"] != nonce:
                        return
                    withdrawn = await pipe.smembers(k.withdrawn)
                    current = await self.version()
                    pipe.multi()
                    for (entry, prompt), group in landed:
                        pid = str(json.loads(entry)["pid"])
                        if pid in withdrawn:
                            pipe.srem(k.withdrawn, pid)
                            continue
                        item = {"prompt": prompt.model_dump(mode="json"), "group": group.model_dump(mode="json")}
                        fields = {"item": json.dumps(item), "entry": entry}
                        pipe.xadd(k.ready, {**fields, "version": oldest_version(group, current)})
                    pipe.delete(k.generating).hdel(k.stats, "error")
                    await pipe.execute()
                    return
                except WatchError:
                    continue

    async def _lease_orphans(self, k: Keys) -> None:
        """Entries delivered by a replica that died before it wrote their lease: deliverable again."""
        stuck = await self.r.xpending_range(k.ready, GROUP, min="-", max="+", count=100, idle=ORPHAN_IDLE_MS)
        for entry in stuck:
            if await self.r.zscore(k.leases, entry["message_id"]) is None:
                await self.r.zadd(k.leases, {entry["message_id"]: 0}, nx=True)

    # pulls and acks -------------------------------------------------------------------------------------
    async def pull(self, req: P.PullRequest) -> P.PullResponse:
        _, nonce = await self.get(req.source)
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
        for item in items:
            for s in item.group.samples:
                metrics.STALENESS.observe(max(0, current - s.weight_version))
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

    async def ack(self, item_ids: list[str]) -> P.AckResponse:
        """Settle delivered groups, whatever their lease state; acking again changes nothing."""
        acked, already, unknown = [], [], []
        nonces: dict[str, str | None] = {}
        for item_id in item_ids:
            name, nonce, entry_id = (item_id.split(":") + ["", ""])[:3]
            if name not in nonces:
                found = await self._source(name) if name else None
                nonces[name] = found[1] if found else None
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


class QueueGauges:
    """farm_queue_ready_groups and farm_queue_leased_groups per source, as of the last states() (GET /metrics
    refreshes them before it renders)."""

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
            for s in queue.snapshot:
                ready.add_metric([s.name], s.ready)
                leased.add_metric([s.name], s.leased)
        return [ready, leased]


GAUGES = QueueGauges()
REGISTRY.register(GAUGES)
