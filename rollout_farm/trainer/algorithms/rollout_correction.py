"""What remains between the distribution that drew the samples and the policy being trained, corrected.

The trainer's policy is the sampled one up to what the logits alone cannot say: top-k/top-p truncation, a lagging
weight version, the engine's numerics. For each response token the service reports its logprob under the
distribution it was drawn from (q: logits / T, truncated and renormalised); the trainer has its own old logprob
(pi_old, logits / T). verl's rollout-correction helper turns log(pi_old / q) into importance weights
(`algorithm.rollout_correction`, verl's keys):

    rollout_is            token (each token's ratio), sequence (the product over the response), or null (none)
    rollout_is_threshold  2.0: truncated IS, the weights capped there; "0.5_5.0": masked IS (IcePop), tokens
                          whose weight falls outside the bounds get weight 0
    rollout_rs            rejection: comma-separated verl options (token_k1, seq_mean_k3, ...) that drop tokens
                          or whole responses whose divergence passes rollout_rs_threshold

A resampling sampler's `importance_weight` (it maps the delivered samples back to q) multiplies in as the service
sent it. Those are Horvitz-Thompson weights, already scaled so that a group's total is n in expectation. Dividing
them by each group's actual mean (self-normalising) biases the gradient when groups are small: on the bandit of
tests/unit/test_sampler_math.py (n = 4 kept from 8) by 12 standard errors, where the weights as sent are
unbiased. Samples the service drew without reporting q (greedy, or an engine that cannot) get no
correction and are counted in `rollout_corr/unknown_fraction`.

The step logs the mismatch, under verl's names: rollout_corr/kl (KL(q || pi_old), estimated on the samples),
rollout_corr/k3_kl, rollout_corr/rollout_is_mean, _max, rollout_corr/rollout_is_ratio_fraction_high and _low (the
fraction past the bounds: clipped or masked), rollout_corr/rollout_rs_masked_fraction.
"""

from __future__ import annotations

import torch
from verl.trainer.ppo import rollout_corr_helper

from rollout_farm.trainer.batch import Batch
from rollout_farm.trainer.config import RolloutCorrection

# of verl's ~30 metrics, the ones a step logs: the mismatch, the weights, the share clipped, masked or rejected
LOGGED = {
    f"rollout_corr/{k}"
    for k in (
        "kl",
        "k3_kl",
        "chi2_token",
        "rollout_is_mean",
        "rollout_is_max",
        "rollout_is_ratio_fraction_high",
        "rollout_is_ratio_fraction_low",
        "rollout_is_oob_ratio",
        "rollout_rs_masked_fraction",
        "rollout_rs_seq_masked_fraction",
    )
}


def correction(
    old_lp: torch.Tensor, b: Batch, cfg: RolloutCorrection
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(weights (B, R) for the policy-gradient term, the response mask after rejection (B, R), metrics)."""
    known = b.sampling_known.bool()[:, None]
    rollout_lp = torch.where(known, b.sampling_logprobs, old_lp)  # no report: no correction
    mask = b.response_mask.float()
    metrics = {"rollout_corr/unknown_fraction": 1.0 - b.sampling_known.float().mean().item()}
    if not mask.any():
        return torch.zeros_like(mask), mask, metrics
    proto, mask, verl_metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        old_lp,
        rollout_lp,
        mask,
        rollout_is=cfg.rollout_is,
        rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_is_batch_normalize=cfg.rollout_is_batch_normalize,
        rollout_rs=cfg.rollout_rs,
        rollout_rs_threshold=cfg.rollout_rs_threshold,
    )
    weights = proto.batch["rollout_is_weights"] if proto is not None else mask.clone()
    iw = b.importance_weights.to(weights.dtype)
    metrics |= {k: float(v) for k, v in verl_metrics.items() if k in LOGGED}
    metrics |= {"importance_weight_max": iw.max().item(), "importance_weight_min": iw.min().item()}
    return weights * iw[:, None] * mask, mask, metrics
