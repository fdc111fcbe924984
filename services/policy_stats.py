"""What the trainer last reported about its policy (POST /v1/policy_stats), and the sampling plans samplers make
from it."""

from __future__ import annotations

import logging

from services import metrics
from services import protocol as P
from services.samplers import Sampler, SamplerState

log = logging.getLogger("farm.service")


class PolicyStatsBoard:
    def __init__(self):
        self.stats = P.PolicyStats()
        self.temperatures: dict[str, float] = {}  # the temperature each sampler chose last

    def report(self, update: P.PolicyStats) -> P.PolicyStats:
        """Merge a report: fields left out keep their last value."""
        self.stats = self.stats.model_copy(update=update.model_dump(exclude_unset=True))
        gauges = (
            (metrics.POLICY_KL, self.stats.kl),
            (metrics.POLICY_REWARD_VAR, self.stats.reward_var),
            (metrics.POLICY_STEP, self.stats.step),
        )
        for gauge, value in gauges:
            if value is not None:
                gauge.set(value)
        log.info("policy_stats", extra=self.stats.model_dump())
        return self.stats

    def plan(
        self, name: str, sampler: Sampler, sampling: P.SamplingParams, version: int
    ) -> tuple[P.SamplingParams, dict]:
        """The sampling params the sampler picks for this request, and the metadata every sample carries."""
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
        metrics.SAMPLER_TEMPERATURE.labels(name).set(params.temperature)
        return params, {"sampler": name, **meta}
