"""The step's advantages: outcome rewards on each response's last token, the KL penalty in the reward, the
configured estimator (trainer/estimators.py), and truncated importance weights for recomputed old logprobs.

Old logprobs (`actor_rollout_ref.actor.old_logprobs`):
  rollout    the logprobs the service reported: raw-model logprobs of the very weights the trainer holds
             (every sample's weight_version is checked), so no forward pass is needed. The default.
  recompute  a forward pass of the trainer's policy before the update. When samples were drawn off-policy
             (a lagging weight version, importance resampling), the policy-gradient term of each token is
             weighted by the truncated importance ratio min(exp(old - rollout), rollout_is_threshold).
"""

from __future__ import annotations

import torch

from trainer import losses
from trainer.batch import Batch
from trainer.config import Config
from trainer.estimators import ESTIMATORS, AdvInput


def compute_advantages(
    cfg: Config, kl_ctrl, b: Batch, old_lp: torch.Tensor, ref_lp: torch.Tensor, values: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(advantages (B, R), returns (B, R), metrics). `kl_ctrl` is verl's KL controller: use_kl_in_reward moves it."""
    alg = cfg.algorithm
    token_rewards = losses.outcome_to_token_rewards(b.rewards, b.response_mask)
    metrics = {}
    if alg.use_kl_in_reward:
        token_rewards, metrics["kl_in_reward"] = kl_in_reward(token_rewards, kl_ctrl, b, old_lp, ref_lp, alg.kl_penalty)
    x = AdvInput(
        token_rewards,
        b.response_mask,
        b.group_ids,
        values=values,
        gamma=alg.gamma,
        lam=alg.lam,
        norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        variance_threshold=alg.variance_threshold,
    )
    adv, returns, info = ESTIMATORS.get(alg.adv_estimator)(x)
    metrics.update(info, adv_var=losses.masked_var(adv, b.response_mask).item())
    if cfg.actor_rollout_ref.actor.old_logprobs == "recompute":  # truncated IS against the rollout's logprobs
        tis = torch.exp(old_lp - b.rollout_logprobs).clamp(max=alg.rollout_is_threshold) * b.response_mask
        adv = adv * tis
        metrics["rollout_is_mean"] = losses.masked_mean(tis, b.response_mask).item()
    return adv, returns, metrics


def kl_in_reward(
    token_rewards: torch.Tensor, kl_ctrl, b: Batch, old_lp: torch.Tensor, ref_lp: torch.Tensor, kind: str
) -> tuple[torch.Tensor, float]:
    """verl's apply_kl_penalty: r_t - beta * KL_t, then the controller moves beta. Returns the penalised token
    rewards (B, R) and the batch's mean KL."""
    kld = losses.kl_penalty(old_lp, ref_lp, kind) * b.response_mask
    token_rewards = token_rewards - kl_ctrl.value * kld
    current = losses.masked_mean(kld, b.response_mask).item()
    kl_ctrl.update(current_kl=current, n_steps=len(b))
    return token_rewards, current
