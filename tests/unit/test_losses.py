"""The PPO losses and KL estimators (rollout_farm/trainer/algorithms/losses.py) against naive loops."""

import math

import numpy as np
import pytest
import torch

from rollout_farm.trainer.algorithms import losses
from rollout_farm.trainer.algorithms.estimators import ESTIMATORS, AdvInput


def test_grpo_matches_naive_loop():
    torch.manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 3.0, 2.0])
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 2, 3])
    lengths = [3, 1, 4, 2, 4, 4, 1, 2, 3]
    mask = torch.zeros(9, 4)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    adv, _, _ = ESTIMATORS.get("grpo")(AdvInput(losses.outcome_to_token_rewards(rewards, mask), mask, groups))
    for i in range(9):
        peers = [rewards[j].item() for j in range(9) if groups[j] == groups[i]]
        if len(peers) == 1:
            mean, std = 0.0, 1.0  # verl's rule for a group of one
        else:
            mean = sum(peers) / len(peers)
            std = math.sqrt(sum((x - mean) ** 2 for x in peers) / (len(peers) - 1))  # unbiased, like torch.std
        expected = (rewards[i].item() - mean) / (std + 1e-6)
        for t in range(4):
            assert adv[i, t].item() == pytest.approx(expected if t < lengths[i] else 0.0, abs=1e-5)
    assert torch.all(adv[4:7] == 0)  # a zero-variance group has zero advantage


def naive_ppo_loss(old, new, adv, mask, eps, c):
    total, count = 0.0, 0
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if not mask[i, t]:
                continue
            ratio = math.exp(new[i, t] - old[i, t])
            a = adv[i, t].item()
            loss = max(-a * ratio, -a * min(max(ratio, 1 - eps), 1 + eps))
            if a < 0:
                loss = min(loss, -a * c)  # dual-clip
            total, count = total + loss, count + 1
    return total / count


def test_ppo_loss_matches_naive_loop():
    torch.manual_seed(1)
    old = torch.randn(6, 5) - 2
    new = old + torch.randn(6, 5) * 0.8  # ratios well outside the clip range
    adv = torch.randn(6, 5) * 2
    mask = (torch.rand(6, 5) > 0.3).float()
    loss, metrics = losses.ppo_loss(old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(naive_ppo_loss(old, new, adv, mask, 0.2, 3.0), rel=1e-5)
    assert 0 < metrics["actor/pg_clipfrac"] < 1


def test_dual_clip_bounds_negative_advantages():
    old = torch.zeros(1, 4)
    new = torch.tensor([[math.log(10.0), math.log(50.0), math.log(1.0), math.log(0.5)]])  # ratios 10, 50, 1, 0.5
    adv = torch.full((1, 4), -1.0)
    mask = torch.ones(1, 4)
    loss, _ = losses.ppo_loss(old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0, loss_agg_mode="seq-mean-token-sum")
    # per token: min(max(-A*r, -A*clip(r)), -A*c) -> 3, 3 (bounded, not 10 or 50), 1, 0.8
    assert loss.item() == pytest.approx(3 + 3 + 1 + 0.8, rel=1e-5)
    # the gradient through a dual-clipped token is zero: it cannot push a huge ratio further
    new.requires_grad_(True)
    loss, _ = losses.ppo_loss(old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    loss.backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] == 0 and new.grad[0, 2] != 0


def test_kl_estimators():
    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    k1 = losses.kl_penalty(lp, ref, "kl")
    k3 = losses.kl_penalty(lp, ref, "low_var_kl")
    assert torch.allclose(k1, lp - ref)
    r = ref - lp
    assert torch.allclose(k3, (r.exp() - 1 - r).clamp(-10, 10), atol=1e-6)
    assert torch.all(k3 >= 0)


def test_outcome_reward_on_last_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    out = losses.outcome_to_token_rewards(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[0, 0, 2.0, 0], [-1.0, 0, 0, 0]]
