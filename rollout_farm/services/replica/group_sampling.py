"""Drawing the groups of one chunk on an engine replica: the sampler's rounds of candidates, decoding, scoring,
and the sampler's selection. One bad reward marks its sample ("error"), not the batch."""

from __future__ import annotations

import logging
import math
import random
import statistics
from collections.abc import Awaitable, Callable

from rollout_farm.services import protocol as P
from rollout_farm.services.chat.template import prompt_ids
from rollout_farm.services.engine import EngineOutput
from rollout_farm.services.errors import described
from rollout_farm.services.extensions import rewards
from rollout_farm.services.extensions.samplers import Sampler
from rollout_farm.services.replica.seeds import round_params

log = logging.getLogger("farm.service")

Generate = Callable[[list[list[int]], P.SamplingParams], Awaitable[list[EngineOutput]]]


async def sample_groups(
    generate: Generate,
    tokenizer,
    prompts: list[P.Prompt],
    n: int,
    params: P.SamplingParams,
    reward: str | None,
    meta: dict,
    sampler: Sampler,
) -> list[P.Group]:
    """The groups of these prompts: up to sampler.candidates(n) candidates each, in rounds of round_size(n), a group
    leaving the rounds once the sampler has `enough`; then the sampler selects each group's samples."""
    rng = random.Random(params.seed)
    m, step = sampler.candidates(n), max(1, sampler.round_size(n))
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    candidates: list[list[P.Sample]] = [[] for _ in prompts]
    live = list(range(len(prompts)))  # groups still generating: each round adds `step` candidates to each
    for r in range(-(-m // step)):
        k = min(step, m - r * step)
        outs = await generate([ids[i] for i in live for _ in range(k)], round_params(params, r))
        for j, i in enumerate(live):
            candidates[i] += [
                to_sample(o, tokenizer, prompts[i], reward, meta, sampler.wants_log_ratio, params)
                for o in outs[j * k : (j + 1) * k]
            ]
        live = [i for i in live if not sampler.enough(candidates[i], n)]
        if not live:
            break
    return [
        group(ids[i], samples, sampler.select(samples, n, rng), sampler, m != n) for i, samples in enumerate(candidates)
    ]


def group(
    prompt_ids: list[int], candidates: list[P.Sample], kept: list[P.Sample], sampler: Sampler, counts_candidates: bool
) -> P.Group:
    scores = [s.reward for s in kept]
    std = statistics.pstdev(scores) if scores else 0.0
    return P.Group(
        prompt_token_ids=prompt_ids,
        samples=kept,
        reward_mean=statistics.fmean(scores) if scores else 0.0,
        reward_std=std,
        zero_variance=std < 1e-6,
        candidates=len(candidates) if counts_candidates else None,
        rejected=sampler.rejected(candidates),
        generated_tokens=sum(len(s.token_ids) for s in candidates),
    )


def to_sample(
    o: EngineOutput,
    tokenizer,
    prompt: P.Prompt,
    reward: str | None,
    meta: dict,
    log_ratio: bool,
    params: P.SamplingParams,
) -> P.Sample:
    """An engine output, decoded and scored; `params` are the sampling params it was generated with."""
    text = tokenizer.decode(o.token_ids, skip_special_tokens=True)
    reason, r = o.finish_reason, 0.0
    try:
        r = float(rewards.REWARDS.get(reward)(text, prompt.ground_truth)) if reward else 0.0
    except Exception as e:
        log.warning("reward_failed", extra={"reward": reward, "error": described(e)})
        reason = "error"
    if log_ratio and o.sampling_logprobs is not None:  # log p/q of the sample: raw policy over the distribution sampled
        meta = {**meta, "log_ratio": sum(o.logprobs) - sum(o.sampling_logprobs)}
    mixed = o.token_versions if len(set(o.token_versions)) > 1 else None
    return P.Sample(
        token_ids=o.token_ids,
        logprobs=o.logprobs,
        sampling_logprobs=sampling_logprobs(o, params),
        sampled_with=P.SampledWith(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, regex=params.regex is not None
        ),
        text=text,
        finish_reason=reason,
        reward=r,
        weight_version=o.weight_version,
        token_weight_versions=mixed,
        sampler_meta=meta,
    )


def sampling_logprobs(o: EngineOutput, params: P.SamplingParams) -> list[float] | None:
    """The sample's logprobs under the distribution sampled; None when greedy, when the engine cannot tell, or when a
    regex constraint forced a token outside that distribution (-inf, which JSON cannot carry)."""
    slp = o.sampling_logprobs
    if params.temperature == 0 or slp is None or not all(map(math.isfinite, slp)):
        return None
    return slp
