"""Spreading a rollout over the engine replicas: contiguous chunks of prompts (a group stays on one replica),
a seed per chunk (rollout_farm/services/replica/seeds.py), and the version floor (no rollout runs on weights older than
the newest committed)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rollout_farm.services import protocol as P
from rollout_farm.services.adapters.registry import AdapterRegistry
from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.extensions.samplers import make_sampler
from rollout_farm.services.observability import metrics
from rollout_farm.services.replica.handle import Replicas
from rollout_farm.services.replica.seeds import chunk_params
from rollout_farm.services.rollout import group_filter
from rollout_farm.services.rollout.jobs import Job
from rollout_farm.services.rollout.policy_check import check_policy
from rollout_farm.services.rollout.policy_stats import PolicyStatsBoard


def split(items: list, k: int) -> list[list]:
    """items in at most k contiguous, non-empty chunks of near-equal size."""
    k = max(1, min(k, len(items)))
    q, r = divmod(len(items), k)
    bounds = [i * q + min(i, r) for i in range(k + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(k)]


class Fanout:
    def __init__(
        self,
        replicas: Replicas,
        settings: ServiceSettings,
        committed: Callable[[], int],
        policy: PolicyStatsBoard,
        adapters: AdapterRegistry,
    ):
        self.replicas, self.settings, self.committed, self.policy = replicas, settings, committed, policy
        self.adapters = adapters

    async def resolve(self, req: P.RolloutRequest) -> None:
        """The exact adapter version the request samples from, and its digest (once per request): 404 for an unknown
        adapter, 409 naming the resident window for a version outside it."""
        if req.adapter is not None and req._resolved_adapter is None:
            found = await self.adapters.resolve(req.adapter)
            req._resolved_adapter = (P.AdapterRef(name=req.adapter.name, version=found.version), found.digest)

    def floor(self, req: P.RolloutRequest) -> int:
        """The oldest weight version this request may run on."""
        return max(req.min_weight_version, self.committed())

    def call(
        self,
        req: P.RolloutRequest,
        prompts: list[int],
        chunk: int,
        params: P.SamplingParams,
        floor: int,
        meta: dict,
        spec: P.SamplerSpec,
    ):
        """One replica's rollout of these prompts (indices into req.prompts), chunk number `chunk` of the request
        (its seed); await it, or .cancel() it."""
        return self.replicas.call(
            "rollout",
            [req.prompts[i] for i in prompts],
            req.n,
            chunk_params(params, chunk),
            req.reward,
            floor,
            meta,
            spec,
            req.routing_key,
            req.request_id,  # what cut_rollout cuts (/abort_request, DELETE ?partial=true)
            req._resolved_adapter,
            key=req.routing_key,
            local=chunk == 0,  # a fused front runs the first chunk on its own engine, the rest on the others
        )

    async def produce(self, job: Job, req: P.RolloutRequest, delivered: bool = True) -> P.RolloutResponse:
        """The request's groups, each recorded in `job` as it finishes. `delivered`: the caller gets them now
        (a queue's groups count as delivered when pulled)."""
        await self.resolve(req)
        sampler = make_sampler(req.sampler, self.settings.plugins)
        if sampler.filters_groups:
            return await group_filter.produce(self, job, req, sampler, delivered)
        chunks = split(list(range(len(req.prompts))), self.settings.replicas * (2 if req.stream else 1))
        floor = self.floor(req)
        params, meta = await self.policy.plan(req.sampler.name, sampler, req.sampling_params, self.committed())
        calls = [self.call(req, c, j, params, floor, meta, req.sampler) for j, c in enumerate(chunks)]

        async def part(chunk, call):
            for i, group in zip(chunk, check_policy(await call, req._resolved_adapter)):
                group.prompt_index = i
                job.add(i, group)

        try:
            await asyncio.gather(*[part(c, call) for c, call in zip(chunks, calls)])
        except BaseException:
            for call in calls:  # frees the engine work of every part still running
                call.cancel()
            raise
        groups = [job.groups[i] for i in range(job.size)]
        self.record(req.sampler.name, groups, groups if delivered else [])
        return P.RolloutResponse(groups=groups)

    async def generate_for_queue(self, req: P.RolloutRequest) -> list[P.Group]:
        return (await self.produce(Job(len(req.prompts)), req, delivered=False)).groups

    def record(self, sampler: str, generated: list[P.Group], delivered: list[P.Group]) -> None:
        """Per-sampler counts of the groups generated, and the staleness of those delivered now."""
        metrics.record_groups(sampler, generated)
        metrics.record_staleness(delivered, self.committed())
