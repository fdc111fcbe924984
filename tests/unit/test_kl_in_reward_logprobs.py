"""rollout_farm/trainer/loop.py train_step with `old_logprobs=rollout` (verl's bypass mode): the PPO ratio is taken
against the distribution that sampled (the nucleus q the service reports), but the KL penalty in the reward must read
the policy's own pi_T logprobs. Under top-p, q = pi_T / Z on the kept tokens, so reading q adds -log Z to every token's
KL (0.105 per token at Z = 0.9, ten times a 0.01 target).

The model passes are faked (`no_grad_passes`, the PPO epochs and the updated policy's KL): this test checks what
train_step hands to each part, with the real batch, config, advantages and KL controller."""

import math
import types

import pytest
import torch
from verl.trainer.ppo import core_algos

from rollout_farm.services import protocol as P
from rollout_farm.trainer import loop
from rollout_farm.trainer.batch import make_batch
from rollout_farm.trainer.config import load

POLICY, REFERENCE, Z = -1.0, -1.05, 0.9  # pi_T's logprob of every sampled token, the reference's, the nucleus mass


def sample(reward: float) -> P.Sample:
    return P.Sample(
        token_ids=[5, 6, 7],
        logprobs=[POLICY] * 3,
        sampling_logprobs=[POLICY - math.log(Z)] * 3,  # the nucleus q the service sampled from
        text="x",
        finish_reason="length",
        weight_version=3,
        reward=reward,
    )


def run_step(monkeypatch, old_logprobs: str) -> tuple[dict, torch.Tensor]:
    cfg = load(None, ["algorithm.use_kl_in_reward=true", f"actor_rollout_ref.actor.old_logprobs={old_logprobs}"])
    run = types.SimpleNamespace(cfg=cfg, kl_ctrl=core_algos.get_kl_controller(cfg.algorithm.kl_ctrl), version=3)
    group = P.Group(
        prompt_token_ids=[1, 2],
        samples=[sample(1.0), sample(0.0)],
        reward_mean=0.5,
        reward_std=0.5,
        zero_variance=False,
    )
    b = make_batch([group], pad_id=0)
    seen = {}

    def passes(run, b):
        shape = b.response_mask.shape
        kl = torch.full(shape, POLICY - REFERENCE)
        return torch.full(shape, POLICY), torch.full(shape, REFERENCE), kl, kl, None

    def ppo_update(run, b, adv, old_lp, ref_lp, weights, values, returns):
        seen["old_lp"] = old_lp
        return {}

    monkeypatch.setattr(loop, "no_grad_passes", passes)
    monkeypatch.setattr(loop, "ppo_update", ppo_update)
    monkeypatch.setattr(loop, "updated_kl", lambda run, b: (0.0, 0.0))
    return loop.train_step(run, b), seen["old_lp"]


@pytest.mark.parametrize("old_logprobs", ["rollout", "recompute"])
def test_the_kl_in_the_reward_reads_the_policys_logprobs_not_the_nucleus_q(monkeypatch, old_logprobs):
    metrics, ratio_base = run_step(monkeypatch, old_logprobs)
    assert metrics["kl_in_reward"] == pytest.approx(POLICY - REFERENCE, abs=1e-6)  # 0.05, not 0.05 - log 0.9
    expected = POLICY - math.log(Z) if old_logprobs == "rollout" else POLICY  # the ratio's base is still q in bypass
    assert torch.allclose(ratio_base, torch.full_like(ratio_base, expected))
