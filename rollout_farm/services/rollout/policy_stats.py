"""What the trainer last reported about its policy (POST /v1/policy_stats), and the sampling plans samplers make
from it. The report is kept in Redis (farm:<app>:policy, one JSON value per field), so every ingress replica plans
from the same stats; each replica reads it back at least every FOLLOW_S (rollout_farm/services/api/ingress.py)."""

from __future__ import annotations

import contextlib
import json
import logging

from redis.asyncio import Redis

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import STATE_ERRORS
from rollout_farm.services.extensions.samplers import Sampler, SamplerState
from rollout_farm.services.observability import metrics

log = logging.getLogger("farm.service")


class PolicyStatsBoard:
    def __init__(self, r: Redis, prefix: str):
        self.r, self.key, self.temperatures_key = r, f"{prefix}:policy", f"{prefix}:temperatures"
        self.stats = P.PolicyStats()
        self.temperatures: dict[str, float] = {}  # the temperature each sampler chose last (on any replica)

    async def refresh(self) -> P.PolicyStats:
        """The stats and the samplers' last temperatures as Redis has them; the gauges follow."""
        async with self.r.pipeline(transaction=False) as pipe:
            raw, temperatures = await pipe.hgetall(self.key).hgetall(self.temperatures_key).execute()
        self.stats = P.PolicyStats.model_validate({k: json.loads(v) for k, v in raw.items()})
        self.temperatures = {name: float(t) for name, t in temperatures.items()}
        for gauge, value in (
            (metrics.POLICY_KL, self.stats.kl),
            (metrics.POLICY_REWARD_VAR, self.stats.reward_var),
            (metrics.POLICY_STEP, self.stats.step),
        ):
            if value is not None:
                gauge.set(value)
        for name, t in self.temperatures.items():
            metrics.SAMPLER_TEMPERATURE.labels(name).set(t)
        return self.stats

    async def report(self, update: P.PolicyStats) -> P.PolicyStats:
        """Merge a report: fields left out keep their last value."""
        fields = {k: json.dumps(v) for k, v in update.model_dump(mode="json", exclude_unset=True).items()}
        if fields:
            await self.r.hset(self.key, mapping=fields)
        await self.refresh()
        log.info("policy_stats", extra=self.stats.model_dump())
        return self.stats

    async def plan(
        self, name: str, sampler: Sampler, sampling: P.SamplingParams, version: int
    ) -> tuple[P.SamplingParams, dict]:
        """The sampling params the sampler picks for this request (from the stats as of now, whichever replica
        took the report), and the metadata every sample carries. Without Redis, from the stats last read."""
        try:
            await self.refresh()
        except STATE_ERRORS:
            pass
        params, meta = sampler.plan(sampling, SamplerState(stats=self.stats, weight_version=version))
        if self.temperatures.get(name) != params.temperature:
            log.info(
                "sampler_temperature",
                extra={
                    "sampler": name,
                    "temperature": round(params.temperature, 4),
                    "was": self.temperatures.get(name),
                    "kl": self.stats.kl,
                },
            )
            self.temperatures[name] = params.temperature
            with contextlib.suppress(*STATE_ERRORS):
                await self.r.hset(self.temperatures_key, name, params.temperature)
        metrics.SAMPLER_TEMPERATURE.labels(name).set(params.temperature)
        return params, {"sampler": name, **meta}
