"""The actor's update: one step of verl's dual-clip PPO loss per mini-batch, in micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_farm.trainer import distributed
from rollout_farm.trainer.algorithms import losses
from rollout_farm.trainer.algorithms.forward import response_logprobs, temperatures
from rollout_farm.trainer.algorithms.noise_scale import MicroGradients, noise_parts
from rollout_farm.trainer.batch import Batch
from rollout_farm.trainer.config import ActorConfig
from rollout_farm.trainer.minibatches import MiniBatch, micro_batches

PPO_STATS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")  # verl's, averaged over this rank's micro-batches


@dataclass
class ActorInputs:
    """What the actor's steps of one training step read: the policy, the step's batch, and per response token what
    its loss compares with. B samples, R = longest response (the batch's shapes, see rollout_farm/trainer/batch.py)."""

    policy: torch.nn.Module
    """The policy being trained; its parameters get the gradients."""
    batch: Batch
    """The step's batch (B samples); its response_mask (B, R) is the one after the rollout correction's rejection."""
    adv: torch.Tensor
    """(B, R) each response token's advantage."""
    old_lp: torch.Tensor
    """(B, R) the logprobs the PPO ratio is taken against (the policy's before the step, or the rollout's)."""
    ref_lp: torch.Tensor
    """(B, R) the reference policy's logprobs, for the KL loss."""
    weights: torch.Tensor
    """(B, R) the rollout correction's importance weights, on the policy-gradient term."""
    cfg: ActorConfig
    """The actor's settings: clipping, loss aggregation, KL and entropy coefficients, micro-batch size."""


def update_actor(x: ActorInputs, optimizer: torch.optim.Optimizer, mb: MiniBatch, measure_noise: bool = False) -> dict:
    """One optimizer step on this rank's share of mini-batch `mb`. Every loss is aggregated over the whole
    mini-batch's token and sample counts (loss_agg_mode), so the gradients summed over micro-batches and ranks are
    the mini-batch's. Returns its pg_loss, kl_loss and entropy (summed over ranks), grad_norm and the PPO
    statistics; with measure_noise, also the two parts of the gradient noise scale
    (rollout_farm/trainer/algorithms/noise_scale.py)."""
    policy, b, a = x.policy, x.batch, x.cfg
    totals, parts = torch.zeros(3, device=b.response_mask.device), {k: [] for k in PPO_STATS}
    optimizer.zero_grad()
    micro = MicroGradients(list(policy.parameters())) if measure_noise else None
    for m in micro_batches(mb.idx, a.ppo_micro_batch_size_per_gpu):
        pg_loss, kl, ent, pg = _backward(x, m, mb.share)
        totals += torch.stack([pg_loss, kl, ent]).detach()
        for k in PPO_STATS:
            parts[k].append(float(pg.get(f"actor/{k}", 0.0)))
        if micro is not None:
            micro.record(*loss_share(b.response_mask[m], mb.share, a.loss_agg_mode))
    distributed.sum_gradients(policy)
    noise = {}
    if micro is not None:
        trace, g2 = noise_parts(micro.sq_norms, micro.sizes, micro.squared_norm(), mb.share["global_batch_size"])
        noise = {"grad_noise_trace": trace, "grad_noise_g2": g2}
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), a.grad_clip)
    optimizer.step()
    pg_total, kl_total, ent_total = distributed.all_reduce_sum(totals).tolist()  # shares -> whole
    means = {k: sum(v) / len(v) if v else 0.0 for k, v in parts.items()}
    return {
        "pg_loss": pg_total,
        "kl_loss": kl_total,
        "entropy": ent_total,
        "grad_norm": grad_norm.item(),
        **means,
        **noise,
    }


def loss_share(mask: torch.Tensor, share: dict, loss_agg_mode: str) -> tuple[float, int]:
    """A micro-batch's share of the mini-batch's loss (tokens for token-mean, else samples) and its sample count."""
    samples = int((mask.sum(-1) > 0).sum())
    if loss_agg_mode == "token-mean":
        return float(mask.sum()) / share["batch_num_tokens"], samples
    return samples / share["global_batch_size"], samples


def _backward(x: ActorInputs, m: torch.Tensor, share: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Backpropagate the loss of micro-batch `m` (sample indices); returns its pg_loss, kl, entropy (this rank's
    shares of the mini-batch's) and verl's PPO metrics."""
    a = x.cfg
    mb, mask = x.batch.select(m), x.batch.response_mask[m]
    lp, entropy = response_logprobs(x.policy, mb, temperatures(mb, a), with_entropy=True)
    pg_loss, pg = losses.ppo_loss(
        x.old_lp[m], lp, x.adv[m], mask, a.clip_ratio, a.clip_ratio_c, a.loss_agg_mode, share, x.weights[m]
    )
    kl = losses.aggregate(losses.kl_penalty(lp, x.ref_lp[m], a.kl_loss_type), mask, a.loss_agg_mode, share)
    ent = losses.aggregate(entropy, mask, a.loss_agg_mode, share)
    (pg_loss - a.entropy_coeff * ent + (a.kl_loss_coef * kl if a.use_kl_loss else 0.0)).backward()
    return pg_loss, kl, ent, pg
