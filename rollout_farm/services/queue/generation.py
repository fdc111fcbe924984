"""The queue's background generation (a part of TrajectoryQueue, rollout_farm/services/queue/trajectory_queue.py): one
ingress replica at a time generates for a source, holding its `owner` key (a 5 s lease it keeps extending). When that
replica dies the key lapses, another replica claims the source within SUPERVISE_S, and what the dead one was generating
goes back to the front of `pending`. A batch's groups land in the ready stream in one transaction, only while this
replica still owns the source. A paused farm only delays generation: a batch that waited FARM_PAUSE_WAIT_S on the
pause (FarmPaused) goes back to the front of `pending`, not counted as an error, and is generated after the resume."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

from redis.exceptions import WatchError

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import FarmPaused, Overloaded, described
from rollout_farm.services.extensions.tasks import TASKS
from rollout_farm.services.observability import metrics
from rollout_farm.services.protocol import episodes as E
from rollout_farm.services.queue.store import GROUP, Keys, dataset_prompts, prompt_entries
from rollout_farm.services.tenants.registry import Principal

log = logging.getLogger("farm.queue")

IDLE_S = 0.2  # an owner with nothing to generate looks again this often
PAUSED_RETRY_S = 1.0  # after a batch that waited on a paused farm to the bound, the owner tries again this much later
SUPERVISE_S = 0.5  # how often a replica looks for sources nobody generates for
ORPHAN_IDLE_MS = 30_000  # a delivered entry with no lease (its ingress died between the two) gets one after this


class QueueGeneration:
    """TrajectoryQueue's generation side; it uses the queue's r, prefix, owner, running, cursors, generate,
    generate_episodes, version, batch_groups, sources_key, _source() and state()."""

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
                log.warning("queue_supervise_failed", extra={"error": described(e)})
            await asyncio.sleep(SUPERVISE_S)

    async def _recover(self, k: Keys) -> None:
        """What a previous owner was generating goes back to the front of pending, in order."""
        moved = 0
        while await self.r.lmove(k.generating, k.pending, "RIGHT", "LEFT") is not None:
            moved += 1
        if moved:
            log.warning("queue_generation_recovered", extra={"source": k.owner, "prompts": moved})

    async def _generate_for(self, name: str) -> None:
        """While this replica owns the source: keep target_groups groups ready, a batch at a time. Each turn of the
        loop counts, in the source's stats, as busy (it generated a batch) or idle (nothing it was allowed to
        generate: no prompt pending, or target_groups ready)."""
        k, batch = Keys(self.prefix, name), 0
        keepalive = asyncio.create_task(self._keep_owning(k))
        clock = asyncio.get_running_loop().time
        try:
            while not keepalive.done():
                start = clock()
                found = await self._source(name)
                if found is None:
                    return
                spec, nonce, owner = found
                await self._lease_orphans(k)
                state = await self.state(name)
                need = spec.target_groups - state.ready
                taken = await self._take(k, spec, min(need, self.batch_groups)) if need > 0 else []
                if not taken:
                    await asyncio.sleep(IDLE_S)
                    await self.r.hincrbyfloat(k.stats, "idle_s", clock() - start)
                    continue
                batch += 1
                await self._generate_batch(k, spec, nonce, taken, batch, owner)
                await self.r.hincrbyfloat(k.stats, "busy_s", clock() - start)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("queue_owner_stopped", extra={"source": name, "error": described(e)})
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

    async def _generate_batch(
        self, k: Keys, spec: P.QueueSource, nonce: str, taken, batch: int, owner: str | None = None
    ) -> None:
        """A batch of the source's groups; an episode source's sessions are its owner's (a tenant's, or None)."""
        params = (
            spec.sampling_params
            if spec.sampling_params.seed is None
            else spec.sampling_params.model_copy(update={"seed": (spec.sampling_params.seed + batch) % 2**63})
        )
        reward = spec.reward or (TASKS.get(spec.dataset).reward if spec.dataset else None)
        common = {"prompts": [p for _, p in taken], "n": spec.n, "sampling_params": params, "sampler": spec.sampler}
        common["adapter"] = spec.adapter
        try:  # a tenant's batch counts against its quota and fair share, as its own requests do
            async with self.admitted(Principal(tenant=owner), len(taken) * spec.n) as took:
                if spec.episodes is not None:
                    episodes = E.EpisodeRequest(**spec.episodes.model_dump(), **common)
                    groups = await self.generate_episodes(episodes, owner)
                else:
                    groups = await self.generate(P.RolloutRequest(**common, reward=reward))
                took(sum(len(s.token_ids) for g in groups for s in g.samples))
        except asyncio.CancelledError:
            raise
        except Overloaded as e:  # the owner's quota or share is used up: the prompts wait at the front
            await self._recover(k)
            log.info("queue_generation_refused", extra={"source": spec.name, "owner": owner, "error": e.message})
            await asyncio.sleep(e.retry_after_s)
            return
        except FarmPaused:  # the farm is paused: the prompts wait at the front until it resumes; not an error
            await self._recover(k)
            log.info("queue_generation_paused", extra={"source": spec.name, "prompts": len(taken)})
            await asyncio.sleep(PAUSED_RETRY_S)
            return
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
                        pipe.xadd(k.ready, {**fields, "version": group.oldest_version(current)})
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
