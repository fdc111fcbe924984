"""Every advantage estimator against a naive loop; the control variate's unbiasedness."""

import math
import statistics

import numpy as np
import pytest
import torch

from trainer.estimators import ESTIMATORS, AdvInput, adaptive_lambda


def batch(seed=0, groups=4, n=3, R=5):
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R)[None] < lengths[:, None]).float()
    rewards = torch.randint(0, 2, (B,), generator=g).float() + 0.1 * torch.rand(B, generator=g)
    token_rewards = torch.zeros(B, R)
    token_rewards[torch.arange(B), lengths - 1] = rewards
    values = torch.randn(B, R, generator=g) * mask
    return AdvInput(token_rewards, mask, np.repeat(np.arange(groups), n), values=values, gamma=0.99, lam=0.9)


def whiten(x, mask):
    xs = [v for row, m in zip(x.tolist(), mask.tolist()) for v, k in zip(row, m) if k]
    mean, var = statistics.fmean(xs), statistics.variance(xs)
    return (x - mean) / math.sqrt(var + 1e-8) * mask


def naive_gae(x, lam):
    adv = torch.zeros_like(x.token_rewards)
    for i in range(len(adv)):
        T = int(x.response_mask[i].sum())
        last = 0.0
        for t in reversed(range(T)):
            next_v = x.values[i, t + 1].item() if t + 1 < T else 0.0
            delta = x.token_rewards[i, t].item() + x.gamma * next_v - x.values[i, t].item()
            last = delta + x.gamma * lam * last
            adv[i, t] = last
    return whiten(adv, x.response_mask)


def per_group(x):
    groups = {}
    for i, gid in enumerate(x.group_ids):
        groups.setdefault(gid, []).append(i)
    return groups


def test_gae_matches_a_naive_loop():
    x = batch()
    adv, _, info = ESTIMATORS.get("gae")(x)
    assert torch.allclose(adv, naive_gae(x, 0.9), atol=1e-5) and info["lam"] == 0.9


def test_grpo_and_rloo_match_naive_loops():
    x = batch(1)
    r = x.scores
    grpo, rloo = torch.zeros_like(r), torch.zeros_like(r)
    for idx in per_group(x).values():
        rs = [r[i].item() for i in idx]
        for i in idx:
            grpo[i] = (r[i] - statistics.fmean(rs)) / (statistics.stdev(rs) + 1e-6)
            rloo[i] = r[i] - statistics.fmean([r[j].item() for j in idx if j != i])
    assert torch.allclose(ESTIMATORS.get("grpo")(x)[0], grpo[:, None] * x.response_mask, atol=1e-5)
    assert torch.allclose(ESTIMATORS.get("rloo")(x)[0], rloo[:, None] * x.response_mask, atol=1e-5)


def test_reinforce_plus_plus_and_its_baseline_variant_match_naive_loops():
    x = batch(2)
    ret = torch.zeros_like(x.token_rewards)
    for i in range(len(ret)):
        run = 0.0
        for t in reversed(range(int(x.response_mask[i].sum()))):
            run = x.token_rewards[i, t].item() + x.gamma * run
            ret[i, t] = run
    assert torch.allclose(ESTIMATORS.get("reinforce_plus_plus")(x)[0], whiten(ret, x.response_mask), atol=1e-5)
    r = x.scores.clone()
    for idx in per_group(x).values():
        mean = statistics.fmean(r[i].item() for i in idx)
        for i in idx:
            r[i] -= mean
    assert torch.allclose(
        ESTIMATORS.get("reinforce_plus_plus_baseline")(x)[0],
        whiten(r[:, None] * x.response_mask, x.response_mask),
        atol=1e-5,
    )


def test_adaptive_lambda_follows_the_documented_rule():
    assert adaptive_lambda(0.0, 0.2) == pytest.approx(0.98)
    assert adaptive_lambda(0.2, 0.2) == pytest.approx(0.95)
    assert adaptive_lambda(0.3, 0.2) == pytest.approx(0.935)
    assert adaptive_lambda(1.0, 0.2) == pytest.approx(0.90)
    x = batch(3)
    adv, _, info = ESTIMATORS.get("adaptive_gae")(x)
    lam = adaptive_lambda(x.scores.var(unbiased=False).item(), x.variance_threshold)
    assert info["lam"] == lam and torch.allclose(adv, naive_gae(x, lam), atol=1e-5)


def test_estimators_that_need_a_critic_say_so():
    x = batch()
    x.values = None
    with pytest.raises(ValueError, match="critic.enable"):
        ESTIMATORS.get("control_variate")(x)


def test_control_variate_is_unbiased_and_has_lower_variance_than_plain_reinforce():
    """A bandit per prompt: K arms, softmax policy, n samples per prompt. The gradient estimate
    sum_i A_i grad log pi(a_i) / N with A = r (plain REINFORCE) and with the control variate must agree
    in expectation (Monte Carlo, a 99.9% interval per component), and the control variate's must vary less."""
    K, prompts, n, trials = 4, 8, 4, 3000
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    logits = torch.tensor(rng.normal(size=(prompts, K)), dtype=torch.float32)
    means = torch.tensor(
        rng.uniform(2, 3, size=(prompts, K)), dtype=torch.float32
    )  # a large offset: where a baseline pays
    probs = torch.softmax(logits, -1)
    values = (probs * means).sum(-1) + torch.tensor(
        rng.normal(0, 0.3, size=prompts), dtype=torch.float32
    )  # a decent, imperfect critic
    group_ids = np.repeat(np.arange(prompts), n)
    plain, cv = [], []
    for _ in range(trials):
        arms = torch.multinomial(probs, n, replacement=True)  # (prompts, n)
        r = (means.gather(1, arms) + torch.tensor(rng.normal(0, 0.5, size=(prompts, n)), dtype=torch.float32)).reshape(
            -1
        )
        x = AdvInput(r[:, None], torch.ones(len(r), 1), group_ids, values=values.repeat_interleave(n)[:, None])
        a_cv = ESTIMATORS.get("control_variate")(x)[0][:, 0]
        score = torch.nn.functional.one_hot(arms.reshape(-1), K) - probs.repeat_interleave(
            n, 0
        )  # grad of log softmax wrt logits
        plain.append((r[:, None] * score).sum(0) / len(r))
        cv.append((a_cv[:, None] * score).sum(0) / len(r))
    plain, cv = torch.stack(plain), torch.stack(cv)
    diff = cv - plain  # paired: same draws
    half = 3.3 * diff.std(0) / math.sqrt(trials)  # 99.9% per component: 4 components, one false alarm in ~250 runs
    assert (diff.mean(0).abs() <= half + 1e-4).all(), (diff.mean(0), half)
    assert (cv.var(0) < 0.5 * plain.var(0)).all()
