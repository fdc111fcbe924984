"""Samplers: how the service draws the samples of one request (named in a request's `sampler`).

A sampler is registered by name, or named by a dotted path `pkg.module:Class` whose module is listed
in FARM_PLUGINS (a request cannot make the service import anything else). Its `Params` model checks
the request's `sampler.params`, so a typo is a 422 naming the field.

Where each hook runs:
  ingress  `problems`  422 detail for what the params alone cannot say (e.g. more groups than prompts)
           `plan`      the sampling params the engines use, from the request's own and the sampler state
                       (the trainer's last POST /v1/policy_stats, the committed weight version), and the
                       metadata every sample carries in `sampler_meta`
  replica  `candidates` / `round_size` / `enough`   how many samples to generate per group, in rounds of
                       round_size, stopping a group early once `enough` holds
           `select` / `rejected`   which samples the group returns, and how many candidates were refused
A sampler with `filters_groups` (dynamic_group_filter) runs at the ingress over the request's groups and
draws each group with its `inner` sampler.
"""

from __future__ import annotations

import math
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_farm.services import protocol as P
from rollout_farm.services.extensions.registry import Registry


class NoParams(P.RequestModel):
    """A sampler's params: unknown keys, NaN, infinite and subnormal floats and NUL bytes are refused (422)."""

    model_config = ConfigDict(extra="forbid")


class SamplerState(BaseModel):
    """What a sampler may read: the trainer's last POST /v1/policy_stats and the committed weight version."""

    stats: P.PolicyStats = Field(default_factory=P.PolicyStats)
    weight_version: int = 0


class Sampler:
    Params: type[BaseModel] = NoParams
    filters_groups = False  # True: runs at the ingress over whole groups (see DynamicGroupFilter)
    wants_log_ratio = (
        False  # True: each candidate's sampler_meta gets log_ratio = log p/q (raw policy over the distribution sampled)
    )

    def __init__(self, params: BaseModel):
        self.params = params

    def problems(self, prompts: int | None, engine: str) -> list[dict]:
        """At the ingress: 422 detail ({field, message}; field relative to the params) for what the params cannot say
        alone. `prompts`: the request's prompt count, or None for a queue source."""
        return []

    def plan(self, sampling: P.SamplingParams, state: SamplerState) -> tuple[P.SamplingParams, dict]:
        """At the ingress: the sampling params to use, and metadata for each sample; by default the request's own."""
        return sampling, {}

    def effective(self, sampling: P.SamplingParams, plugins: list[str] | None) -> P.SamplingParams:
        """Not called by the service: the sampling params a request with `sampling` is drawn with, before any policy
        stats are reported (plan's, at the initial state). A trainer reads its truncation (top_p, top_k, regex)
        before it starts. `plugins`: as make_sampler's, for a sampler that builds another."""
        return self.plan(sampling, SamplerState())[0]

    def candidates(self, n: int) -> int:
        """In the replica: the most samples to generate for a group of n."""
        return n

    def round_size(self, n: int) -> int:
        """In the replica: samples generated per group and round; a group whose samples are `enough` gets no more
        rounds."""
        return self.candidates(n)

    def enough(self, samples: list[P.Sample], n: int) -> bool:
        """In the replica, after each round: stop generating for this group (its surplus is never started)."""
        return False

    def select(self, samples: list[P.Sample], n: int, rng: random.Random) -> list[P.Sample]:
        """In the replica: the group's samples from the scored candidates (their sampler_meta may be extended)."""
        return samples

    def rejected(self, samples: list[P.Sample]) -> int | None:
        """In the replica: how many candidates the sampler refused, if it refuses any."""
        return None


SAMPLERS: Registry[type[Sampler]] = Registry("sampler", base=Sampler)


def describe() -> dict[str, str]:
    """Each registered sampler's name and docstring."""
    return {name: (SAMPLERS.get(name).__doc__ or "").strip() for name in SAMPLERS.names()}


def make_sampler(spec: P.SamplerSpec, plugins: list[str]) -> Sampler:
    """The sampler a request names (registered, or `pkg.module:Class` from a FARM_PLUGINS module), with its params
    checked (KeyError, pydantic.ValidationError)."""
    kind = SAMPLERS.get(spec.name, plugins)
    return kind(kind.Params.model_validate(spec.params))


@SAMPLERS.register("plain")
class Plain(Sampler):
    """n samples per prompt with the requested sampling params: the baseline."""


class KLAdaptiveParams(NoParams):
    base_temperature: P.Temperature = Field(
        0.7, ge=0, le=100, description="Temperature while the reported KL is low (or not reported)."
    )
    low_temperature: P.Temperature = Field(
        0.5, ge=0, le=100, description="Temperature once the reported KL is above kl_threshold."
    )
    top_p: P.Float = Field(0.9, gt=0, le=1, description="Nucleus mass, whatever the KL.")
    kl_threshold: P.Float = Field(0.02, ge=0, description="Reported KL above which the temperature drops.")
    schedule: Literal["step", "smooth"] = Field(
        "step", description="'step' switches at the threshold; 'smooth' follows a logistic curve around it."
    )
    smooth_width: P.Float = Field(
        0.005, gt=0, description="For 'smooth': the KL distance over which the temperature moves most of the way."
    )

    @model_validator(mode="after")
    def _low_below_base(self) -> "KLAdaptiveParams":
        if self.low_temperature > self.base_temperature:
            raise ValueError(
                "low_temperature must not exceed base_temperature: the sampler cools the policy when KL grows"
            )
        return self


@SAMPLERS.register("kl_adaptive_temperature")
class KLAdaptiveTemperature(Sampler):
    """Temperature that falls from base_temperature to low_temperature when the trainer's reported KL passes
    kl_threshold (a step, or a smooth logistic schedule); top_p fixed. The request's temperature and top_p are
    replaced."""

    Params = KLAdaptiveParams

    def temperature(self, kl: float | None) -> float:
        p = self.params
        if kl is None:
            return p.base_temperature
        if p.schedule == "step":
            return p.low_temperature if kl > p.kl_threshold else p.base_temperature
        x = max(-60.0, min(60.0, (kl - p.kl_threshold) / p.smooth_width * 4))  # 4: the logistic's ~12-88% per width
        t = p.base_temperature - (p.base_temperature - p.low_temperature) / (1 + math.exp(-x))
        return 0.0 if t < P.MIN_TEMPERATURE else t  # on the way to a greedy low_temperature: greedy, not 1e-30

    def plan(self, sampling: P.SamplingParams, state: SamplerState) -> tuple[P.SamplingParams, dict]:
        t = self.temperature(state.stats.kl)
        return sampling.model_copy(update={"temperature": t, "top_p": self.params.top_p}), {
            "temperature": t,
            "kl": state.stats.kl,
        }


class ImportanceParams(NoParams):
    candidates: int | None = Field(
        None,
        ge=1,
        le=P.MAX_N * 4,
        description="Candidates m generated per group (at least n); n distinct ones are kept. Default 2n.",
    )
    target: Literal["reward_tilt", "policy_ratio"] = Field(
        "reward_tilt",
        description="What the kept samples lean towards. 'reward_tilt': the density proportional to q(x) exp(beta "
        "r(x)); 'policy_ratio': the raw policy p(x) (temperature 1, no top-p/k). q is the distribution the candidates "
        "were drawn from (the request's sampling params). Each kept sample's importance_weight maps it back to q.",
    )
    beta: P.Float = Field(1.0, ge=-50, le=50, description="reward_tilt's strength; 0 keeps a uniform draw of n.")


@SAMPLERS.register("importance_resampling")
class ImportanceResampling(Sampler):
    """Generate m candidates from q (the request's sampling params) and keep n of them, without duplicates, by
    priority sampling (Duffield, Lund & Thorup 2007) on target weights w_i: exp(beta r_i) for 'reward_tilt', or
    p(x_i)/q(x_i) for 'policy_ratio' (the raw policy over the distribution actually sampled; needs an engine that
    reports sampling logprobs: torch). Each candidate gets the key w_i / u_i, u_i ~ Uniform(0, 1]; the n largest
    keys are kept, and tau is the (n+1)-th largest. A kept sample's sampler_meta carries importance_weight
    = (n/m) max(1, tau / w_i), its Horvitz-Thompson weight scaled so that the mean over the group of
    importance_weight * f(x_i) is an unbiased estimate of the candidates' mean of f, hence of E_q[f]: it maps the
    delivered samples back to q, the distribution sampled (the trainer then corrects q to its policy with its
    rollout-correction ratio, and uses these weights as sent: in its loss and its group baselines). It also
    carries the candidate count m,
    the effective sample size of the normalised w (a small one means a few candidates dominate) and, for
    'policy_ratio', the sample's log ratio log p/q. With m <= n every candidate is kept with weight 1."""

    Params = ImportanceParams

    def problems(self, prompts: int | None, engine: str) -> list[dict]:
        if self.params.target == "policy_ratio" and engine != "torch":
            return [
                {
                    "field": "target",
                    "message": "'policy_ratio' needs the sampling logprobs that only the torch engine reports "
                    f"(FARM_ENGINE={engine}); use 'reward_tilt'",
                }
            ]
        return []

    @property
    def wants_log_ratio(self) -> bool:
        return self.params.target == "policy_ratio"

    def candidates(self, n: int) -> int:
        return max(n, self.params.candidates or 2 * n)

    def select(self, samples: list[P.Sample], n: int, rng: random.Random) -> list[P.Sample]:
        m = len(samples)
        log_w = (
            [self.params.beta * s.reward for s in samples]
            if self.params.target == "reward_tilt"
            else [s.sampler_meta["log_ratio"] for s in samples]
        )
        top = max(log_w)
        w = [math.exp(x - top) for x in log_w]  # shifted: no overflow
        ess = sum(w) ** 2 / sum(x * x for x in w)
        if m <= n:
            return [self.weighted(s, 1.0, m, ess) for s in samples]
        # log keys, log(w_i / u_i) with u_i in (0, 1]: no underflow, and tau / w_i <= 1 / u_i <= 2**53 when kept
        keys = [x - math.log(1.0 - rng.random()) for x in log_w]
        order = sorted(range(m), key=keys.__getitem__, reverse=True)
        log_tau = keys[order[n]]
        return [
            self.weighted(samples[i], n / m * max(1.0, math.exp(log_tau - log_w[i])), m, ess) for i in sorted(order[:n])
        ]

    @staticmethod
    def weighted(s: P.Sample, importance_weight: float, m: int, ess: float) -> P.Sample:
        """A kept sample, its sampler_meta extended with its importance weight, the candidates and the ESS."""
        meta = {**s.sampler_meta, "importance_weight": importance_weight, "candidates": m, "ess": ess}
        return s.model_copy(update={"sampler_meta": meta})


class PatternParams(NoParams):
    pattern: str = Field(
        r"(?s).*#### -?[0-9]+",
        max_length=2000,
        description="A regular expression the whole generated text must match "
        "(the default: a chain ending in GSM8K's '#### <number>').",
    )
    mode: Literal["filter", "constrained"] = Field(
        "filter",
        description="'filter': generate, then keep matches; 'constrained': the engine "
        "masks tokens that cannot lead to a match (SGLang's regex, the torch engine's RegexMask), then keep matches.",
    )
    max_candidates: int | None = Field(
        None, ge=1, le=P.MAX_N * 4, description="Most candidates per group, generated n per round; default 4n."
    )

    # the same check, and message, as sampling_params.regex
    _compiles = field_validator("pattern")(P.SamplingParams._regex_compiles.__func__)


@SAMPLERS.register("pattern_conditional")
class PatternConditional(Sampler):
    """Keep only samples whose text fully matches `pattern`. Candidates are generated in rounds of n until n match
    or max_candidates are spent (a group may return fewer than n; an empty group is zero-variance). The group's
    `candidates` and `rejected` count the work and the refusals; in 'constrained' mode the engine steers every
    token towards a match, so far fewer are refused."""

    Params = PatternParams

    def __init__(self, params: PatternParams):
        import regex

        super().__init__(params)
        self.rx = regex.compile(params.pattern)

    def plan(self, sampling: P.SamplingParams, state: SamplerState) -> tuple[P.SamplingParams, dict]:
        if self.params.mode == "constrained":
            sampling = sampling.model_copy(update={"regex": self.params.pattern})
        return sampling, {"mode": self.params.mode}

    def candidates(self, n: int) -> int:
        return max(n, self.params.max_candidates or 4 * n)

    def round_size(self, n: int) -> int:
        return n

    def matches(self, s: P.Sample) -> bool:
        return s.finish_reason in ("stop", "length") and self.rx.fullmatch(s.text) is not None

    def enough(self, samples: list[P.Sample], n: int) -> bool:
        return sum(map(self.matches, samples)) >= n

    def select(self, samples: list[P.Sample], n: int, rng: random.Random) -> list[P.Sample]:
        return [s for s in samples if self.matches(s)][:n]

    def rejected(self, samples: list[P.Sample]) -> int:
        return sum(not self.matches(s) for s in samples)


class FilterParams(NoParams):
    target_groups: int | None = Field(
        None,
        ge=1,
        le=P.MAX_PROMPTS,
        description="Informative groups to return; default: one per prompt "
        "(no over-sampling). Send more prompts than this to over-sample.",
    )
    max_groups: int | None = Field(
        None, ge=1, le=P.MAX_PROMPTS, description="Cap on groups started; default: every prompt."
    )
    std_tolerance: P.Float = Field(
        1e-6, ge=0, le=1e3, description="A group whose reward std is at most this is zero-variance and dropped."
    )
    prompts_per_call: int = Field(
        2, ge=1, le=64, description="Prompts per engine call: smaller calls let the filter stop sooner."
    )
    inner: P.SamplerSpec = Field(
        default_factory=P.SamplerSpec, description="The sampler that draws each group (any but dynamic_group_filter)."
    )

    @field_validator("inner")
    @classmethod
    def _not_itself(cls, v: P.SamplerSpec) -> P.SamplerSpec:
        if v.name == "dynamic_group_filter":
            raise ValueError("must not be dynamic_group_filter: the filter drops groups that another sampler draws")
        return v

    @model_validator(mode="after")
    def _sane(self) -> "FilterParams":
        if self.target_groups and self.max_groups and self.max_groups < self.target_groups:
            raise ValueError("max_groups must be at least target_groups")
        return self


@SAMPLERS.register("dynamic_group_filter")
class DynamicGroupFilter(Sampler):
    """DAPO's dynamic sampling, at the ingress: drop groups whose reward std is within std_tolerance (all rewards equal,
    compared on the std, not the mean), and draw groups from the request's prompts, prompts_per_call per engine call,
    until target_groups informative ones are kept or max_groups were started. Calls still running then are cancelled
    (their engine work stops at the next token). The response's `filter` report gives the zero-variance fraction and
    the over-sampling waste."""

    Params = FilterParams
    filters_groups = True

    def problems(self, prompts: int | None, engine: str) -> list[dict]:
        out = []
        for name in ("target_groups", "max_groups"):
            if prompts is None and getattr(self.params, name):
                out.append(
                    {
                        "field": name,
                        "message": "a queue source keeps its target_groups informative groups ready: leave this unset",
                    }
                )
            elif prompts is not None and (getattr(self.params, name) or 0) > prompts:
                out.append(
                    {
                        "field": name,
                        "message": f"at most the number of prompts ({prompts}): send more prompts to over-sample from",
                    }
                )
        return out

    def effective(self, sampling: P.SamplingParams, plugins: list[str] | None) -> P.SamplingParams:
        return make_sampler(self.params.inner, plugins).effective(sampling, plugins)  # each group: the inner's

    def zero_variance(self, group: P.Group) -> bool:
        return group.reward_std <= self.params.std_tolerance
