"""How far behind the trainer the samples of a step are, and what the rollout correction did to the late ones.

The staleness of a sample is the trainer's version when it trains on it (the version of the policy the step starts
from: the one it pushed last) minus the oldest weight version among the sample's response tokens. A sample
generated while a weight commit with the in-flight policy "partial" landed spans two versions or more; its oldest
token counts, because every later token was drawn conditioned on it. The per-token versions are kept in the batch
(Batch.token_versions) and their lag is logged too (token_staleness_mean). The rollout correction needs no
version at all: each token's behaviour logprob was reported by the weights that drew it, so the importance weight
pi_old / q of a token is right whichever version drew it.

A step logs (metrics.jsonl; rollout_farm/trainer/outputs/step_metrics.py exports the scalars as gauges):
  staleness_hist            samples by lag: [lag 0, lag 1, ...]
  staleness_mean, _max      over the samples
  token_staleness_mean      over the response tokens
  spanning_samples          samples whose tokens come from more than one version
  offpolicy_fraction        samples with lag > 0
  offpolicy_is_weight_mean  the mean importance weight the step applied to their tokens (None when there are none)
  offpolicy_clipped_fraction  of their tokens, those whose weight the truncation capped (truncated IS)
  offpolicy_masked_fraction   those given weight 0: outside masked IS's bounds, or rejected by rollout_rs
"""

from __future__ import annotations

import torch
from verl.trainer.ppo import rollout_corr_helper as h

from rollout_farm.trainer.batch import Batch
from rollout_farm.trainer.config import RolloutCorrection


def sample_staleness(b: Batch, version: int) -> torch.Tensor:
    """(B,) the trainer's version minus each sample's oldest token version."""
    return version - b.oldest_versions


def staleness_metrics(b: Batch, version: int) -> dict:
    lag = sample_staleness(b, version).clamp(min=0)
    mask = b.response_mask.bool().cpu()
    tokens = (version - b.token_versions)[mask].clamp(min=0).float()
    big = torch.iinfo(torch.long).max
    newest = torch.where(mask, b.token_versions, -big).max(dim=1).values
    spanning = (newest > b.oldest_versions) & mask.any(dim=1)
    return {
        "staleness_hist": torch.bincount(lag).tolist(),
        "staleness_mean": lag.float().mean().item(),
        "staleness_max": int(lag.max()),
        "token_staleness_mean": tokens.mean().item() if len(tokens) else 0.0,
        "spanning_samples": int(spanning.sum()),
        "offpolicy_fraction": (lag > 0).float().mean().item(),
    }


def offpolicy_correction(
    b: Batch,
    version: int,
    old_lp: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    cfg: RolloutCorrection,
) -> dict:
    """What the correction did to the tokens of the samples with lag > 0 whose behaviour logprobs the service
    reported: `weights` and `mask` are rollout_correction.correction()'s (the weights applied, the mask after
    rejection); the raw ratio is recomputed here to tell a capped weight from one that was small already."""
    late = (sample_staleness(b, version) > 0).to(old_lp.device) & b.sampling_known.bool()
    real = b.response_mask.bool()
    tokens = late[:, None] & real
    if not tokens.any():
        return {"offpolicy_is_weight_mean": None, "offpolicy_clipped_fraction": 0.0, "offpolicy_masked_fraction": 0.0}
    log_ratio = (old_lp - b.sampling_logprobs).masked_fill(~real, 0.0)
    if cfg.rollout_is == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(old_lp)
    raw = log_ratio.clamp(-h.SAFETY_BOUND, h.SAFETY_BOUND).exp()
    upper, lower = h._parse_rollout_is_threshold(cfg.rollout_is_threshold)
    clipped = torch.zeros_like(tokens)
    zeroed = real & ~mask.bool()  # rejected by rollout_rs
    if cfg.rollout_is is not None:
        if lower is None:
            clipped = raw > upper
        else:
            zeroed = zeroed | (raw < lower) | (raw > upper)
    n = tokens.sum()
    return {
        "offpolicy_is_weight_mean": (weights[tokens].sum() / n).item(),
        "offpolicy_clipped_fraction": ((clipped & tokens).sum() / n).item(),
        "offpolicy_masked_fraction": ((zeroed & tokens).sum() / n).item(),
    }
