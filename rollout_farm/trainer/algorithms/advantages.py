"""The step's advantages: outcome rewards on each response's last token, the KL penalty in the reward, and the
configured estimator (rollout_farm/trainer/algorithms/estimators.py), with the samples' importance weights in its
group baselines.

Two rules on top of the estimator:
  - Zero-variance groups: under a group baseline (grpo, rloo, reinforce_plus_plus_baseline), a group whose task
    rewards are all equal gets zero advantage. Otherwise the KL penalty alone would differ between its samples,
    and GRPO's division by the group's tiny std would blow that into advantages of +-1.
  - adv_var_rloo: the variance of RLOO's advantages on the same batch and rewards, logged next to adv_var, so an
    estimator's variance is compared with RLOO's on the very same samples.
The KL controller moves on the exact KL (rollout_farm/trainer/algorithms/forward.py: policy_and_reference), not a
one-token estimate.
"""

from __future__ import annotations

import torch

from rollout_farm.trainer.algorithms import losses
from rollout_farm.trainer.algorithms.estimators import ESTIMATORS, GROUP_BASELINES, AdvInput
from rollout_farm.trainer.batch import Batch
from rollout_farm.trainer.config import Config


def compute_advantages(
    cfg: Config,
    kl_ctrl,
    b: Batch,
    old_lp: torch.Tensor,
    ref_lp: torch.Tensor,
    values: torch.Tensor | None,
    kl: float,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(advantages (B, R), returns (B, R), metrics). `kl_ctrl` is verl's KL controller: use_kl_in_reward moves it
    towards its target with `kl`, the batch's exact KL to the reference."""
    alg = cfg.algorithm
    token_rewards = losses.outcome_to_token_rewards(b.rewards, b.response_mask)
    metrics = {}
    if alg.use_kl_in_reward:
        token_rewards, metrics["kl_in_reward"] = kl_in_reward(token_rewards, kl_ctrl, b, old_lp, ref_lp, alg.kl_penalty)
        kl_ctrl.update(current_kl=kl, n_steps=len(b))
    x = AdvInput(
        token_rewards,
        b.response_mask,
        b.groups,
        values=values,
        gamma=alg.gamma,
        lam=alg.lam,
        norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        variance_threshold=alg.variance_threshold,
        long_response_length=alg.long_response_length,
        weights=b.importance_weights,
    )
    adv, returns, info = ESTIMATORS.get(alg.adv_estimator)(x)
    informative = informative_samples(b)
    if alg.adv_estimator in GROUP_BASELINES:
        adv = adv * informative[:, None]
    rloo = ESTIMATORS.get("rloo")(x)[0] * informative[:, None]
    metrics.update(info, adv_var=losses.masked_var(adv, b.response_mask).item())
    metrics.update(adv_var_rloo=losses.masked_var(rloo, b.response_mask).item())
    metrics.update(zero_variance_fraction=1.0 - informative.float().mean().item())
    return adv, returns, metrics


def informative_samples(b: Batch, tolerance: float = 1e-6) -> torch.Tensor:
    """(B,) True for the samples of groups whose task rewards (no KL term) are not all equal."""
    r = b.rewards.float()
    ids = torch.unique(b.group_ids, return_inverse=True)[1].to(r.device)
    n = int(ids.max()) + 1
    high = torch.full((n,), float("-inf"), device=r.device).scatter_reduce(0, ids, r, "amax")
    low = torch.full((n,), float("inf"), device=r.device).scatter_reduce(0, ids, r, "amin")
    return (high - low)[ids] > tolerance


def kl_in_reward(
    token_rewards: torch.Tensor, kl_ctrl, b: Batch, old_lp: torch.Tensor, ref_lp: torch.Tensor, kind: str
) -> tuple[torch.Tensor, float]:
    """verl's apply_kl_penalty: r_t - beta * KL_t, each token's KL estimated from its sampled token (`kind`).
    Returns the penalised token rewards (B, R) and that estimate's batch mean."""
    kld = losses.kl_penalty(old_lp, ref_lp, kind) * b.response_mask
    token_rewards = token_rewards - kl_ctrl.value * kld
    return token_rewards, losses.masked_mean(kld, b.response_mask).item()
