"""Samplers: how the service draws the samples of one request (named in a request's `sampler`).

A sampler is registered by name; its `Params` model checks the request's `sampler.params`, so a
typo is a 422 naming the field. At the ingress, `plan` turns the request's sampling params and the
sampler state (the policy statistics the trainer last reported, the committed weight version) into
the sampling params the engines use, and the metadata every sample carries in `sampler_meta`.
"""

from __future__ import annotations

import math
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services import protocol as P
from services.registry import Registry


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplerState(BaseModel):
    """What a sampler may read: the trainer's last POST /v1/policy_stats and the committed weight version."""

    stats: P.PolicyStats = Field(default_factory=P.PolicyStats)
    weight_version: int = 0


class Sampler:
    Params: type[BaseModel] = NoParams

    def __init__(self, params: BaseModel):
        self.params = params

    def plan(self, sampling: P.SamplingParams, state: SamplerState) -> tuple[P.SamplingParams, dict]:
        """At the ingress: the sampling params to use, and metadata for each sample; by default the request's own."""
        return sampling, {}

    def candidates(self, n: int) -> int:
        """In the replica: how many samples to generate for a group of n."""
        return n

    def select(self, samples: list[P.Sample], n: int, rng: random.Random) -> list[P.Sample]:
        """In the replica: the group's n samples from the scored candidates (their sampler_meta may be extended)."""
        return samples


SAMPLERS: Registry[type[Sampler]] = Registry("sampler")


@SAMPLERS.register("plain")
class Plain(Sampler):
    """n samples per prompt with the requested sampling params: the baseline."""


class KLAdaptiveParams(NoParams):
    base_temperature: float = Field(0.7, ge=0, le=100, description="Temperature while the reported KL is low (or not reported).")
    low_temperature: float = Field(0.5, ge=0, le=100, description="Temperature once the reported KL is above kl_threshold.")
    top_p: float = Field(0.9, gt=0, le=1, description="Nucleus mass, whatever the KL.")
    kl_threshold: float = Field(0.02, ge=0, description="Reported KL above which the temperature drops.")
    schedule: Literal["step", "smooth"] = Field("step", description="'step' switches at the threshold; 'smooth' follows a logistic curve around it.")
    smooth_width: float = Field(0.005, gt=0, description="For 'smooth': the KL distance over which the temperature moves most of the way.")

    @model_validator(mode="after")
    def _low_below_base(self) -> "KLAdaptiveParams":
        if self.low_temperature > self.base_temperature:
            raise ValueError("low_temperature must not exceed base_temperature: the sampler cools the policy when KL grows")
        return self


@SAMPLERS.register("kl_adaptive_temperature")
class KLAdaptiveTemperature(Sampler):
    """Temperature that falls from base_temperature to low_temperature when the trainer's reported KL passes kl_threshold
    (a step, or a smooth logistic schedule); top_p fixed. The request's temperature and top_p are replaced."""

    Params = KLAdaptiveParams

    def temperature(self, kl: float | None) -> float:
        p = self.params
        if kl is None:
            return p.base_temperature
        if p.schedule == "step":
            return p.low_temperature if kl > p.kl_threshold else p.base_temperature
        x = max(-60.0, min(60.0, (kl - p.kl_threshold) / p.smooth_width * 4))  # 4: the logistic's ~12%..88% span per width
        return p.base_temperature - (p.base_temperature - p.low_temperature) / (1 + math.exp(-x))

    def plan(self, sampling: P.SamplingParams, state: SamplerState) -> tuple[P.SamplingParams, dict]:
        t = self.temperature(state.stats.kl)
        return sampling.model_copy(update={"temperature": t, "top_p": self.params.top_p}), {"temperature": t, "kl": state.stats.kl}


class ImportanceParams(NoParams):
    candidates: int | None = Field(None, ge=1, le=P.MAX_N * 4, description="Candidates m generated per group (m >= n); default 2n.")
    target: Literal["reward_tilt"] = Field("reward_tilt", description="'reward_tilt': target density proportional to p(x) exp(beta r(x)).")
    beta: float = Field(1.0, ge=-50, le=50, description="Tilt strength; 0 resamples uniformly.")


@SAMPLERS.register("importance_resampling")
class ImportanceResampling(Sampler):
    """Generate m >= n candidates, resample n of them (with replacement) by self-normalised weights
    exp(beta r) of the reward tilt. Each sample's sampler_meta carries importance_weight = (1/m) / its resampling
    probability, the estimated ratio p/q that corrects the trainer's off-policy bias, and the weights' effective sample size."""

    Params = ImportanceParams

    def candidates(self, n: int) -> int:
        return max(n, self.params.candidates or 2 * n)

    def select(self, samples: list[P.Sample], n: int, rng: random.Random) -> list[P.Sample]:
        scored = [s.reward for s in samples]
        top = max(scored)
        w = [math.exp(self.params.beta * (r - top)) for r in scored]  # shifted: no overflow
        probs = [x / sum(w) for x in w]
        ess = 1 / sum(p * p for p in probs)
        picks = rng.choices(range(len(samples)), weights=probs, k=n)
        return [samples[i].model_copy(update={"sampler_meta": {**samples[i].sampler_meta, "importance_weight": 1 / (len(samples) * probs[i]),
                                                               "candidates": len(samples), "ess": ess}}) for i in picks]
