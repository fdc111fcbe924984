"""Samplers as pure functions: the KL schedule, importance resampling to a reward tilt and to the policy ratio."""

import statistics

import pytest

from services import protocol as P
from services.samplers import KLAdaptiveParams, KLAdaptiveTemperature


def test_smooth_schedule_moves_monotonically_through_the_midpoint():
    s = KLAdaptiveTemperature(
        KLAdaptiveParams(
            schedule="smooth", base_temperature=0.7, low_temperature=0.5, kl_threshold=0.02, smooth_width=0.005
        )
    )
    temps = [s.temperature(kl) for kl in (0.0, 0.01, 0.015, 0.02, 0.025, 0.03, 0.1)]
    assert all(a > b for a, b in zip(temps, temps[1:]))
    assert (
        temps[3] == pytest.approx(0.6)
        and temps[0] == pytest.approx(0.7, abs=1e-3)
        and temps[-1] == pytest.approx(0.5, abs=1e-6)
    )
    assert s.temperature(None) == 0.7


def fake_samples(rewards):
    """Scored candidates as the replica builds them (only the reward matters to the resampler)."""
    return [
        P.Sample(
            token_ids=[1],
            logprobs=[0.0],
            text="",
            finish_reason="stop",
            reward=r,
            weight_version=0,
            sampler_meta={"sampler": "x"},
        )
        for r in rewards
    ]


def test_importance_resampling_reproduces_the_tilted_target_and_its_weights_undo_it():
    import math
    import random

    from services.samplers import ImportanceParams, ImportanceResampling

    beta, p, m, n, groups = 1.0, 0.3, 64, 4, 3000
    sampler, rng, draw = (
        ImportanceResampling(ImportanceParams(candidates=m, beta=beta)),
        random.Random(0),
        random.Random(1),
    )
    delivered = [
        s
        for _ in range(groups)
        for s in sampler.select(fake_samples([float(draw.random() < p) for _ in range(m)]), n, rng)
    ]
    target = p * math.exp(beta) / (1 - p + p * math.exp(beta))  # E[r] under q ∝ p(x) exp(beta r)
    mean = statistics.fmean(s.reward for s in delivered)
    sem = statistics.pstdev(s.reward for s in delivered) / math.sqrt(
        groups
    )  # groups are the independent units; n per group share candidates
    assert (
        abs(mean - target) < 4 * sem * math.sqrt(n) + 1 / m
    )  # within the CI, plus the O(1/m) bias of self-normalisation
    weights = [s.sampler_meta["importance_weight"] for s in delivered]
    corrected = sum(w * s.reward for w, s in zip(weights, delivered)) / sum(weights)
    assert abs(corrected - p) < 0.02  # the returned weights take the trainer back to the behaviour policy's expectation
    assert (
        len(delivered) == groups * n
        and delivered[0].sampler_meta["candidates"] == m
        and delivered[0].sampler_meta["sampler"] == "x"
    )


def test_importance_resampling_to_the_policy_ratio_reaches_the_raw_policy():
    """Candidates from q, weights p/q from their log ratios: the delivered mean is p's, within a CI."""
    import math
    import random

    from services.samplers import ImportanceParams, ImportanceResampling

    q, p, m, n, groups = (
        0.5,
        0.2,
        64,
        4,
        3000,
    )  # Bernoulli "texts": reward 1 with prob q under the sampler, p under the policy
    sampler, rng, draw = (
        ImportanceResampling(ImportanceParams(candidates=m, target="policy_ratio")),
        random.Random(0),
        random.Random(1),
    )
    assert sampler.wants_log_ratio

    def candidates():
        out = fake_samples([float(draw.random() < q) for _ in range(m)])
        return [
            s.model_copy(
                update={"sampler_meta": {"log_ratio": math.log(p / q) if s.reward else math.log((1 - p) / (1 - q))}}
            )
            for s in out
        ]

    delivered = [s for _ in range(groups) for s in sampler.select(candidates(), n, rng)]
    mean = statistics.fmean(s.reward for s in delivered)
    sem = statistics.pstdev(s.reward for s in delivered) / math.sqrt(groups)
    assert abs(mean - p) < 4 * sem * math.sqrt(n) + 1 / m and abs(mean - q) > 0.2
