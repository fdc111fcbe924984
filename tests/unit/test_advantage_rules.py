"""The rules around the estimators: zero-variance groups get no advantage whatever the KL term does, the KL loss
and the entropy follow loss_agg_mode, and samples with no response tokens are not counted."""

import pytest
import torch
from verl.trainer.ppo import core_algos

from rollout_farm.trainer.algorithms import losses
from rollout_farm.trainer.algorithms.advantages import compute_advantages
from rollout_farm.trainer.batch import Batch
from rollout_farm.trainer.config import load
from rollout_farm.trainer.minibatches import mini_batches
from tests.unit.batches import response_batch


def batch(rewards: list[float], groups: list[int], lengths: list[int], R: int = 4) -> Batch:
    mask = (torch.arange(R)[None] < torch.tensor(lengths)[:, None]).long()
    return response_batch(mask, rewards=torch.tensor(rewards), group_ids=torch.tensor(groups))


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_an_all_correct_group_gets_zero_advantage_whatever_the_kl_term_does(estimator):
    """Group 0 is all correct; its samples' KL to the reference differ a little (beta * KL ~ 5e-4). Without the rule,
    GRPO divides that by the group's tiny std and hands out advantages of about +-1."""
    cfg = load(None, [f"algorithm.adv_estimator={estimator}", "algorithm.use_kl_in_reward=true"])
    ctrl = core_algos.get_kl_controller(cfg.algorithm.kl_ctrl)
    b = batch([1, 1, 1, 1, 0, 1, 0, 1], [0, 0, 0, 0, 1, 1, 1, 1], [4] * 8)
    ref = torch.zeros(8, 4)
    old = torch.linspace(0.0, 0.5, 8)[:, None].expand(8, 4).contiguous()  # a KL that differs between samples
    adv, _, metrics = compute_advantages(cfg, ctrl, b, old, ref, None, kl=0.1)
    assert torch.all(adv[:4] == 0) and torch.all(adv[4:].abs().sum(-1) > 0)
    assert metrics["zero_variance_fraction"] == 0.5
    if estimator == "grpo":  # the failure the rule prevents, from verl's GRPO on the same penalised rewards
        raw = core_algos.compute_grpo_outcome_advantage(
            losses.outcome_to_token_rewards(b.rewards, b.response_mask) - 0.001 * (old - ref),
            b.response_mask.float(),
            b.groups,
        )[0]
        assert raw[:4].abs().max() > 0.5


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_kl_loss_and_the_entropy_follow_loss_agg_mode(mode):
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    expected = {"token-mean": 8 / 5, "seq-mean-token-mean": (1 + 4) / 2, "seq-mean-token-sum": (4 + 4) / 2}[mode]
    assert losses.aggregate(x, mask, mode).item() == pytest.approx(expected)


def test_samples_with_empty_responses_are_left_out_of_the_counts():
    b = batch([1, 0, 1, 0], [0, 0, 1, 1], [3, 0, 2, 0])
    (mb,) = list(mini_batches(b, size=2))
    assert mb.share == {"batch_num_tokens": 5, "global_batch_size": 2}
