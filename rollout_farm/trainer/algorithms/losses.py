"""The PPO loss and its pieces (token rewards, KL estimates, masked means) as pure tensor functions.
verl's core_algos does the math; this wraps shapes.

Shapes: B samples, R response tokens (right-padded), V vocabulary.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import torch
from verl.trainer.ppo import core_algos
from verl.workers import config as verl_config


def outcome_to_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """rewards (B,), response_mask (B, R) -> (B, R) with each reward on its sample's last masked token (the last one
    sampled: a multi-turn sample's mask has gaps where observations are)."""
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    positions = torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)
    last = ((response_mask > 0) * positions).max(-1).values.sub(1).clamp(min=0).long()
    out[torch.arange(len(rewards), device=last.device), last] = rewards.float() * (response_mask.sum(-1) > 0)
    return out


@lru_cache(maxsize=8)
def _verl_actor_config(clip_ratio: float, clip_ratio_c: float, loss_agg_mode: str) -> verl_config.ActorConfig:
    return verl_config.ActorConfig(
        strategy="fsdp",
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio,
        clip_ratio_high=clip_ratio,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
    )


def ppo_loss(
    old_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_batch: dict | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """verl's dual-clip PPO policy loss over (B, R) tensors, each token's term times `weights` (the rollout
    correction's); returns (scalar loss, metrics). With micro-batches or data parallelism, `global_batch`
    ({"batch_num_tokens", "global_batch_size"}) makes this loss its share of the whole mini-batch's."""
    cfg = _verl_actor_config(clip_ratio, clip_ratio_c, loss_agg_mode)
    if global_batch:
        cfg = dataclasses.replace(cfg, global_batch_info={"dp_size": 1, **global_batch})
    return core_algos.compute_policy_loss_vanilla(
        old_logprobs, logprobs, advantages, response_mask.float(), loss_agg_mode, cfg, rollout_is_weights=weights
    )


def aggregate(
    loss_mat: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, global_batch: dict | None = None
) -> torch.Tensor:
    """A per-token loss (B, R) to a scalar the way the policy loss is (verl's agg_loss): the KL loss and the
    entropy follow `loss_agg_mode` too. `global_batch` as in ppo_loss."""
    return core_algos.agg_loss(loss_mat, response_mask.float(), loss_agg_mode, **(global_batch or {}))


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate (B, R) of the policy from the reference: k1 'kl', k2 'mse', k3 'low_var_kl'."""
    return core_algos.kl_penalty(logprobs, ref_logprobs, kind)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.float()
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)
