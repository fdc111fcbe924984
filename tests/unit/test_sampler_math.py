"""Samplers as pure functions: the KL schedule; importance resampling (priority sampling, without duplicates) to a
reward tilt and to the policy ratio, and its unbiased weights."""

import functools
import math
import random
import statistics

import pytest

from rollout_farm.services import protocol as P
from rollout_farm.services.extensions.samplers import (
    ImportanceParams,
    ImportanceResampling,
    KLAdaptiveParams,
    KLAdaptiveTemperature,
)


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


def fake_samples(rewards, log_ratios=None):
    """Scored candidates as the replica builds them (the resampler reads the reward, or the log ratio for
    'policy_ratio'); sampler_meta["id"] tells the candidates apart."""
    return [
        P.Sample(
            token_ids=[1],
            logprobs=[0.0],
            text="",
            finish_reason="stop",
            reward=r,
            weight_version=0,
            sampler_meta={"sampler": "x", "id": i, **({"log_ratio": log_ratios[i]} if log_ratios else {})},
        )
        for i, r in enumerate(rewards)
    ]


def z_stats(values):
    """Mean and standard error of independent per-group estimates."""
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def test_importance_resampling_never_returns_a_candidate_twice():
    draw, rng = random.Random(1), random.Random(0)
    for target in ("reward_tilt", "policy_ratio"):
        sampler = ImportanceResampling(ImportanceParams(candidates=8, target=target, beta=5.0))
        for _ in range(500):
            rewards = [draw.choice([0.0, 0.0, 0.0, 1.0]) for _ in range(8)]
            kept = sampler.select(fake_samples(rewards, [3 * r for r in rewards]), 6, rng)
            ids = [s.sampler_meta["id"] for s in kept]
            assert len(ids) == 6 and len(set(ids)) == 6
    everyone = sampler.select(fake_samples([0.0, 1.0, 0.5], [0.0, 2.0, -1.0]), 3, rng)  # m <= n: all, weight 1
    assert [s.sampler_meta["id"] for s in everyone] == [0, 1, 2]
    assert all(s.sampler_meta["importance_weight"] == 1.0 for s in everyone)


# a 5-armed bandit: each candidate is an arm drawn from q; its reward, the raw policy p, and an arbitrary f
ARMS_Q = [0.4, 0.25, 0.15, 0.12, 0.08]
ARMS_P = [0.05, 0.1, 0.15, 0.3, 0.4]
ARMS_R = [0.0, 0.2, 0.5, 0.8, 1.0]
ARMS_F = [1.0, -2.0, 3.0, 0.5, 6.0]


@functools.cache
def bandit_groups(target, groups=4000, m=8, n=4):
    """The arms the real sampler keeps and their importance weights, per group of m candidates drawn from q."""
    sampler = ImportanceResampling(ImportanceParams(candidates=m, target=target, beta=3.0))
    draw, rng = random.Random(1), random.Random(0)
    out = []
    for _ in range(groups):
        arms = draw.choices(range(5), weights=ARMS_Q, k=m)
        log_ratios = [math.log(ARMS_P[a] / ARMS_Q[a]) for a in arms]
        kept = sampler.select(fake_samples([ARMS_R[a] for a in arms], log_ratios), n, rng)
        out.append([(arms[s.sampler_meta["id"]], s.sampler_meta["importance_weight"]) for s in kept])
    return out


@pytest.mark.parametrize("target", ["reward_tilt", "policy_ratio"])
def test_importance_weights_make_the_kept_samples_unbiased_for_q(target):
    """sum_i importance_weight_i f(x_i) / n over a group's kept samples is unbiased for E_q[f] (a z-test over
    independent groups); the unweighted mean of the same samples, the negative control, is not."""
    n, expected = 4, sum(q * f for q, f in zip(ARMS_Q, ARMS_F))
    groups = bandit_groups(target, n=n)
    weighted, se = z_stats([sum(w * ARMS_F[a] for a, w in g) / n for g in groups])
    assert abs(weighted - expected) < 4 * se
    unweighted, se_control = z_stats([statistics.fmean(ARMS_F[a] for a, _ in g) for g in groups])
    assert abs(unweighted - expected) > 8 * se_control


@pytest.mark.parametrize("target", ["reward_tilt", "policy_ratio"])
def test_importance_resampling_tilts_the_kept_samples_towards_the_target(target):
    """The kept arms have more reward than q's draws (both targets put more mass on the high-reward arms), and
    their shares are nearer the target's than q's are (keeping n = m/2, the tilt cannot go all the way)."""
    kept = [a for g in bandit_groups(target) for a, _ in g]
    share = [kept.count(a) / len(kept) for a in range(5)]
    tilt = ARMS_P if target == "policy_ratio" else [q * math.exp(3.0 * r) for q, r in zip(ARMS_Q, ARMS_R)]
    tilt = [t / sum(tilt) for t in tilt]

    def reward(dist):
        return sum(d * r for d, r in zip(dist, ARMS_R))

    def distance(a, b):
        return sum(abs(x - y) for x, y in zip(a, b))

    assert reward(share) > reward(ARMS_Q) + 0.15 and share[3] + share[4] > ARMS_Q[3] + ARMS_Q[4] + 0.15
    assert distance(share, tilt) < 0.75 * distance(ARMS_Q, tilt)


def test_importance_resampling_reproduces_the_tilted_target_and_its_weights_undo_it():
    """With m >> n the kept samples follow the tilt q(x) exp(beta r(x)); their weights take them back to q."""
    beta, p, m, n, groups = 1.0, 0.3, 64, 4, 3000
    sampler, rng, draw = (
        ImportanceResampling(ImportanceParams(candidates=m, beta=beta)),
        random.Random(0),
        random.Random(1),
    )
    kept = [sampler.select(fake_samples([float(draw.random() < p) for _ in range(m)]), n, rng) for _ in range(groups)]
    target = p * math.exp(beta) / (1 - p + p * math.exp(beta))  # E[r] under the density ∝ q(x) exp(beta r)
    mean, se = z_stats([statistics.fmean(s.reward for s in g) for g in kept])
    assert abs(mean - target) < 4 * se + 0.02  # plus the gap of sampling n of m without replacement
    undone, se = z_stats([sum(s.sampler_meta["importance_weight"] * s.reward for s in g) / n for g in kept])
    assert abs(undone - p) < 4 * se  # unbiased for q's expectation
    delivered = [s for g in kept for s in g]
    weights = [s.sampler_meta["importance_weight"] for s in delivered]
    assert abs(sum(w * s.reward for w, s in zip(weights, delivered)) / sum(weights) - p) < 0.02  # self-normalised
    assert (
        len(delivered) == groups * n
        and delivered[0].sampler_meta["candidates"] == m
        and delivered[0].sampler_meta["sampler"] == "x"
    )


def test_importance_resampling_to_the_policy_ratio_reaches_the_raw_policy():
    """Candidates from q, weights p/q from their log ratios: with m >> n the kept mean is near p's."""
    q, p, m, n, groups = 0.5, 0.2, 64, 4, 3000  # Bernoulli "texts": reward 1 with prob q under the sampler, p under p
    sampler, rng, draw = (
        ImportanceResampling(ImportanceParams(candidates=m, target="policy_ratio")),
        random.Random(0),
        random.Random(1),
    )
    assert sampler.wants_log_ratio

    def candidates():
        rewards = [float(draw.random() < q) for _ in range(m)]
        return fake_samples(rewards, [math.log(p / q) if r else math.log((1 - p) / (1 - q)) for r in rewards])

    kept = [sampler.select(candidates(), n, rng) for _ in range(groups)]
    mean, se = z_stats([statistics.fmean(s.reward for s in g) for g in kept])
    assert abs(mean - p) < 4 * se + 0.02 and abs(mean - q) > 0.2
    assert all("log_ratio" in s.sampler_meta for g in kept for s in g)


def trainer_gradients(groups, weighted: bool, normalised: bool = False, n: int = 4):
    """The trainer's policy-gradient estimate per group, for a softmax policy pi = q over the arms: the importance
    weights as the service sent them on each term and in RLOO's leave-one-out baseline
    (rollout_farm/trainer/algorithms/estimators.py, rollout_farm/trainer/algorithms/rollout_correction.py);
    `weighted=False` drops the weights (the negative control), `normalised=True` divides them by their group's mean
    (self-normalising: biased for small groups)."""
    import numpy as np
    import torch

    from rollout_farm.trainer.algorithms.estimators import ESTIMATORS, AdvInput

    q = torch.tensor(ARMS_Q)
    out = []
    for g in groups:
        arms = torch.tensor([a for a, _ in g])
        w = torch.tensor([w for _, w in g]) if weighted else torch.ones(n)
        w = w / w.mean() if normalised else w
        r = torch.tensor([ARMS_R[a] for a in arms.tolist()])
        x = AdvInput(r[:, None], torch.ones(n, 1), np.zeros(n, dtype=int), weights=w)
        adv = ESTIMATORS.get("rloo")(x)[0][:, 0]
        score = torch.nn.functional.one_hot(arms, 5) - q  # grad of log softmax at the arm
        out.append(((w * adv)[:, None] * score).sum(0) / n)
    return torch.stack(out)


def test_the_trainers_weighted_estimator_is_unbiased_for_the_policy_gradient_and_unweighted_it_is_not():
    """Reward-tilted groups (m = 8 candidates from q, n = 4 kept) through the trainer's weighting: the expected
    gradient is grad J(q), the policy that sampled (a z-test per component over 4000 independent groups); without
    the weights it follows the tilt instead, and is rejected; self-normalised per group it is rejected too (why
    the trainer uses the weights as sent)."""
    import torch

    q, r = torch.tensor(ARMS_Q), torch.tensor(ARMS_R)
    exact = (q * r)[:, None] * (torch.eye(5) - q)
    exact = exact.sum(0)
    groups = bandit_groups("reward_tilt")

    def z(g):
        return ((g.mean(0) - exact) / (g.std(0) / math.sqrt(len(g)))).abs().max().item()

    assert z(trainer_gradients(groups, weighted=True)) < 4
    assert z(trainer_gradients(groups, weighted=False)) > 8
    assert z(trainer_gradients(groups, weighted=True, normalised=True)) > 6
