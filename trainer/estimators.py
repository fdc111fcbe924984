"""Advantage estimators behind one registry (`algorithm.adv_estimator`).

verl's `core_algos` computes the ones verl has: gae, grpo, rloo, reinforce_plus_plus,
reinforce_plus_plus_baseline. Ours are registered the same way:

adaptive_gae     GAE with lambda = clip(0.95 + 0.03 * (1 - v / v_thr), 0.90, 0.98), where v is the batch's
                 outcome-reward variance and v_thr `variance_threshold`. A clean signal (v -> 0) gets
                 lambda 0.98, the long-horizon credit assignment long responses need; v = v_thr gives the
                 usual 0.95; a noisy batch lowers lambda (more bias, less variance) down to 0.90 at v >= 2 v_thr.
control_variate  outcome advantage A_i = r_i - b_i with b_i = V_i + c (L_i - V_i): L_i is the leave-one-out
                 mean reward of the other samples of i's group, V_i the critic's value of the prompt (at the
                 first response token), and c = Cov(r - V, L - V) / Var(L - V), the coefficient that
                 minimises Var(r - b), clipped to [0, 1]. c is cross-fitted: estimated on the other half of
                 the batch's groups, so b_i never depends on r_i and E[A_i grad log pi] = E[r_i grad log pi]
                 (unbiased). With c = 1 it is RLOO, with c = 0 a critic baseline.

Every estimator takes an AdvInput and returns (advantages, returns, info), tensors (B, R) zero past each
response, and a dict of scalars to log (adaptive_gae's lambda, control_variate's c).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos

from services.registry import Registry

LAMBDA_MIN, LAMBDA_MAX = 0.90, 0.98


@dataclass
class AdvInput:
    # (B, R): outcome reward on each sample's last token, minus the KL penalty when use_kl_in_reward
    token_rewards: torch.Tensor
    response_mask: torch.Tensor  # (B, R)
    group_ids: np.ndarray  # (B,): samples of one prompt share an id
    values: torch.Tensor | None = None  # (B, R): the critic's values, for gae, adaptive_gae and control_variate
    gamma: float = 1.0  # algorithm.gamma
    lam: float = 0.95  # algorithm.lam
    norm_adv_by_std_in_grpo: bool = True  # algorithm.norm_adv_by_std_in_grpo
    variance_threshold: float = 0.2  # adaptive_gae's v_thr

    @property
    def scores(self) -> torch.Tensor:
        return self.token_rewards.sum(-1)

    def need_values(self, name: str) -> torch.Tensor:
        if self.values is None:
            raise ValueError(f"adv_estimator {name!r} needs a critic: set critic.enable=true")
        return self.values


ESTIMATORS: Registry = Registry("advantage estimator")


@ESTIMATORS.register("gae")
def gae(x: AdvInput) -> tuple[torch.Tensor, torch.Tensor, dict]:
    adv, ret = core_algos.compute_gae_advantage_return(
        x.token_rewards, x.need_values("gae"), x.response_mask.float(), x.gamma, x.lam
    )
    return adv * x.response_mask, ret * x.response_mask, {"lam": x.lam}


@ESTIMATORS.register("grpo")
def grpo(x: AdvInput) -> tuple[torch.Tensor, torch.Tensor, dict]:
    adv, ret = core_algos.compute_grpo_outcome_advantage(
        x.token_rewards,
        x.response_mask.float(),
        x.group_ids,
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=x.norm_adv_by_std_in_grpo,
    )
    return adv, ret, {}


@ESTIMATORS.register("rloo")
def rloo(x: AdvInput) -> tuple[torch.Tensor, torch.Tensor, dict]:
    adv, ret = core_algos.compute_rloo_outcome_advantage(x.token_rewards, x.response_mask.float(), x.group_ids)
    return adv, ret, {}


@ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(x: AdvInput) -> tuple[torch.Tensor, torch.Tensor, dict]:
    adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        x.token_rewards, x.response_mask.float(), config=AlgoConfig(gamma=x.gamma)
    )
    return adv, ret, {}


@ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(x: AdvInput) -> tuple[torch.Tensor, torch.Tensor, dict]:
    adv, ret = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        x.token_rewards, x.response_mask.float(), x.group_ids
    )
    return adv, ret, {}


def adaptive_lambda(reward_variance: float, variance_threshold: float) -> float:
    """0.95 + 0.03 (1 - v / v_thr), clipped to [0.90, 0.98]."""
    return float(np.clip(0.95 + 0.03 * (1 - reward_variance / variance_threshold), LAMBDA_MIN, LAMBDA_MAX))


@ESTIMATORS.register("adaptive_gae")
def adaptive_gae(x: AdvInput) -> tuple[torch.Tensor, torch.Tensor, dict]:
    lam = adaptive_lambda(x.scores.var(unbiased=False).item(), x.variance_threshold)
    adv, ret, _ = gae(replace(x, lam=lam))
    return adv, ret, {"lam": lam}


def _leave_one_out_means(scores: torch.Tensor, group_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean reward of the other samples of each sample's group, whether it has any others)."""
    ids = np.unique(group_ids, return_inverse=True)[1]
    ids = torch.as_tensor(ids, device=scores.device)
    sums = torch.zeros(int(ids.max()) + 1, dtype=scores.dtype, device=scores.device).index_add_(0, ids, scores)
    counts = torch.zeros_like(sums).index_add_(0, ids, torch.ones_like(scores))
    others = counts[ids] - 1
    return (sums[ids] - scores) / others.clamp(min=1), others > 0


def _variance_minimising_c(y: torch.Tensor, d: torch.Tensor) -> float:
    """argmin_c Var(y - c d) = Cov(y, d) / Var(d), clipped to [0, 1]; 1 (RLOO) when d does not vary."""
    if len(y) < 2 or d.var(unbiased=False) < 1e-12:
        return 1.0
    cov = ((y - y.mean()) * (d - d.mean())).mean()
    return float((cov / d.var(unbiased=False)).clamp(0.0, 1.0))


@ESTIMATORS.register("control_variate")
def control_variate(x: AdvInput) -> tuple[torch.Tensor, torch.Tensor, dict]:
    mask = x.response_mask.float()
    r = x.scores
    first = mask.argmax(-1)  # the first response token: its value is V(prompt), fixed before the sample is drawn
    v = x.need_values("control_variate").gather(-1, first[:, None]).squeeze(-1).detach()
    loo, has_others = _leave_one_out_means(r, x.group_ids)
    loo = torch.where(has_others, loo, v)  # a lone sample: the critic alone
    y, d = r - v, loo - v
    group_index = np.unique(x.group_ids, return_inverse=True)[1]
    fold = torch.as_tensor(group_index % 2 == 1, device=r.device)  # whole groups per fold
    c = torch.empty_like(r)
    cs = []
    for f in (False, True):
        other = fold != f
        cs.append(_variance_minimising_c(y[other], d[other]) if other.any() else 1.0)
        c[fold == f] = cs[-1]
    b = v + c * d
    adv = (r - b)[:, None] * mask
    # reward-to-go: the critic's target
    returns = torch.flip(torch.cumsum(torch.flip(x.token_rewards, [-1]), -1), [-1]) * mask
    return adv, returns, {"cv_coef": sum(cs) / 2}
