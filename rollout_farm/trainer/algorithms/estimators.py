"""Advantage estimators behind one registry (`algorithm.adv_estimator`).

verl's `core_algos` computes the ones verl has: gae, grpo, rloo, reinforce_plus_plus,
reinforce_plus_plus_baseline. Ours are registered the same way:

adaptive_gae     GAE with lambda = clip(0.95 + 0.03 * (1 - v / v_thr), 0.90, 0.98), where v is the batch's
                 outcome-reward variance and v_thr `variance_threshold`. A clean signal (v -> 0) gets
                 lambda 0.98; v = v_thr gives the usual 0.95; a noisy batch lowers lambda (more bias, less
                 variance): 0.92 at v = 2 v_thr, and the floor 0.90 from v = 8/3 v_thr. Long responses (a mean
                 length of at least `long_response_length` tokens) get 0.98 whatever v: the long-horizon credit
                 assignment they need.
control_variate  outcome advantage A_i = r_i - b_i with b_i = V_i + c (L_i - V_i): L_i is the leave-one-out
                 mean reward of the other samples of i's group, V_i the critic's value of the prompt (at the
                 first response token), and c = Cov(r - V, L - V) / Var(L - V), the coefficient that
                 minimises Var(r - b), clipped to [0, 1]. c is cross-fitted: estimated on the other half of
                 the batch's groups, so b_i never depends on r_i and E[A_i grad log pi] = E[r_i grad log pi]
                 (unbiased). With c = 1 it is RLOO, with c = 0 a critic baseline.

Every estimator takes an AdvInput and returns (advantages, returns, info), tensors (B, R) zero past each
response, and a dict of scalars to log (adaptive_gae's lambda, control_variate's c).

Importance weights (a resampling sampler's, AdvInput.weights: Horvitz-Thompson weights, mean 1 per group in
expectation) make the group baselines weighted: GRPO's weighted mean and std, RLOO's and control_variate's
weighted leave-one-out mean. With equal weights each is exactly the unweighted one (verl's, for grpo and rloo).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos

from rollout_farm.services.extensions.registry import Registry

LAMBDA_MIN, LAMBDA_MAX = 0.90, 0.98
GROUP_BASELINES = {"grpo", "rloo", "reinforce_plus_plus_baseline"}  # advantages relative to the group's rewards


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
    long_response_length: int | None = 512  # adaptive_gae: lambda 0.98 from this mean response length
    weights: torch.Tensor | None = None  # (B,) importance weights (mean 1 per group in expectation); None: all 1

    @property
    def scores(self) -> torch.Tensor:
        return self.token_rewards.sum(-1)

    @property
    def weighted(self) -> bool:
        return self.weights is not None and not bool(torch.all(self.weights == 1))

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
    if not x.weighted:
        adv, ret = core_algos.compute_grpo_outcome_advantage(
            x.token_rewards,
            x.response_mask.float(),
            x.group_ids,
            epsilon=1e-6,
            norm_adv_by_std_in_grpo=x.norm_adv_by_std_in_grpo,
        )
        return adv, ret, {}
    ids, w, r = _group_index(x.group_ids, x.scores), x.weights, x.scores
    mean = _group_sum(w * r, ids) / _group_sum(w, ids)
    # reliability-weighted variance: with equal weights, the unbiased (n - 1) variance verl's GRPO uses
    sw, sw2 = _group_sum(w, ids), _group_sum(w * w, ids)
    var = _group_sum(w * (r - mean[ids]) ** 2, ids) / (sw - sw2 / sw).clamp(min=1e-12)
    adv = r - mean[ids]
    if x.norm_adv_by_std_in_grpo:
        adv = adv / (var.sqrt()[ids] + 1e-6)
    adv = adv[:, None] * x.response_mask
    return adv, adv, {}


@ESTIMATORS.register("rloo")
def rloo(x: AdvInput) -> tuple[torch.Tensor, torch.Tensor, dict]:
    if not x.weighted:
        adv, ret = core_algos.compute_rloo_outcome_advantage(x.token_rewards, x.response_mask.float(), x.group_ids)
        return adv, ret, {}
    loo, has_others = leave_one_out_means(x.scores, x.group_ids, x.weights)
    adv = ((x.scores - loo) * has_others)[:, None] * x.response_mask
    return adv, adv, {}


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


def adaptive_lambda(
    reward_variance: float,
    variance_threshold: float,
    mean_response_length: float = 0.0,
    long_response_length: int | None = None,
) -> float:
    """0.95 + 0.03 (1 - v / v_thr), clipped to [0.90, 0.98]; 0.98 for long responses."""
    if long_response_length is not None and mean_response_length >= long_response_length:
        return LAMBDA_MAX
    return float(np.clip(0.95 + 0.03 * (1 - reward_variance / variance_threshold), LAMBDA_MIN, LAMBDA_MAX))


@ESTIMATORS.register("adaptive_gae")
def adaptive_gae(x: AdvInput) -> tuple[torch.Tensor, torch.Tensor, dict]:
    length = x.response_mask.sum(-1).float().mean().item()
    lam = adaptive_lambda(x.scores.var(unbiased=False).item(), x.variance_threshold, length, x.long_response_length)
    adv, ret, _ = gae(replace(x, lam=lam))
    return adv, ret, {"lam": lam}


def _group_index(group_ids: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(np.unique(group_ids, return_inverse=True)[1], device=like.device)


def _group_sum(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.zeros(int(ids.max()) + 1, dtype=x.dtype, device=x.device).index_add_(0, ids, x)


def leave_one_out_means(
    scores: torch.Tensor, group_ids: np.ndarray, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the (weighted) mean reward of the other samples of each sample's group, whether it has any others)."""
    ids = _group_index(group_ids, scores)
    w = torch.ones_like(scores) if weights is None else weights.to(scores.dtype)
    sums, totals, counts = _group_sum(w * scores, ids), _group_sum(w, ids), _group_sum(torch.ones_like(scores), ids)
    others = totals[ids] - w
    return (sums[ids] - w * scores) / others.clamp(min=1e-12), counts[ids] > 1


def _variance_minimising_c(y: torch.Tensor, d: torch.Tensor) -> float:
    """argmin_c Var(y - c d) = Cov(y, d) / Var(d), clipped to [0, 1]; 1 (RLOO) when d does not vary."""
    if len(y) < 2 or d.var(unbiased=False) < 1e-12:
        return 1.0
    cov = ((y - y.mean()) * (d - d.mean())).mean()
    return float((cov / d.var(unbiased=False)).clamp(0.0, 1.0))


def control_variate_baseline(
    r: torch.Tensor,
    v: torch.Tensor,
    group_ids: np.ndarray,
    weights: torch.Tensor | None = None,
    cross_fit: bool = True,
    leave_one_out: bool = True,
) -> tuple[torch.Tensor, list[float]]:
    """b_i = V_i + c (L_i - V_i) (see the module's docstring) and the c of each fold. `cross_fit=False` (c from
    the whole batch) and `leave_one_out=False` (L_i includes r_i) are the biased variants the tests must reject."""
    if leave_one_out:
        loo, has_others = leave_one_out_means(r, group_ids, weights)
        loo = torch.where(has_others, loo, v)  # a lone sample: the critic alone
    else:
        ids = _group_index(group_ids, r)
        loo = (_group_sum(r, ids) / _group_sum(torch.ones_like(r), ids))[ids]
    y, d = r - v, loo - v
    if not cross_fit:
        c = _variance_minimising_c(y, d)
        return v + c * d, [c, c]
    fold = torch.as_tensor(np.unique(group_ids, return_inverse=True)[1] % 2 == 1, device=r.device)  # whole groups
    c = torch.empty_like(r)
    cs = []
    for f in (False, True):
        other = fold != f
        cs.append(_variance_minimising_c(y[other], d[other]) if other.any() else 1.0)
        c[fold == f] = cs[-1]
    return v + c * d, cs


@ESTIMATORS.register("control_variate")
def control_variate(x: AdvInput) -> tuple[torch.Tensor, torch.Tensor, dict]:
    mask = x.response_mask.float()
    first = mask.argmax(-1)  # the first response token: its value is V(prompt), fixed before the sample is drawn
    v = x.need_values("control_variate").gather(-1, first[:, None]).squeeze(-1).detach()
    b, cs = control_variate_baseline(x.scores, v, x.group_ids, x.weights if x.weighted else None)
    adv = (x.scores - b)[:, None] * mask
    # reward-to-go: the critic's target
    returns = torch.flip(torch.cumsum(torch.flip(x.token_rewards, [-1]), -1), [-1]) * mask
    return adv, returns, {"cv_coef": sum(cs) / 2}
