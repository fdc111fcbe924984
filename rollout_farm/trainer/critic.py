"""The critic's update: one step of verl's clipped value loss per mini-batch, in the critic's micro-batches."""

from __future__ import annotations

import torch
from verl.trainer.ppo import core_algos

from rollout_farm.trainer import distributed
from rollout_farm.trainer.algorithms.forward import response_values
from rollout_farm.trainer.batch import Batch
from rollout_farm.trainer.config import Config
from rollout_farm.trainer.minibatches import MiniBatch, micro_batches


def update_critic(
    critic: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    b: Batch,
    mb: MiniBatch,
    values: torch.Tensor,
    returns: torch.Tensor,
    cfg: Config,
) -> dict:
    """One optimizer step on this rank's share of mini-batch `mb`, scaled like the actor's (see update_actor).
    `values` are the critic's before the update. Returns vf_loss (summed over ranks) and this rank's vf_clipfrac."""
    a, c = cfg.actor_rollout_ref.actor, cfg.critic
    loss_total, clipfracs = torch.zeros((), device=b.response_mask.device), []
    optimizer.zero_grad()
    for m in micro_batches(mb.idx, c.ppo_micro_batch_size_per_gpu or a.ppo_micro_batch_size_per_gpu):
        mask = b.response_mask[m].float()
        predicted = response_values(critic, b.select(m))
        vf_loss, vf_clipfrac = core_algos.compute_value_loss(
            predicted, returns[m], values[m], mask, c.cliprange_value, a.loss_agg_mode, **mb.share
        )
        vf_loss.backward()
        loss_total += vf_loss.detach()
        clipfracs.append(float(vf_clipfrac))
    distributed.sum_gradients(critic)
    torch.nn.utils.clip_grad_norm_(critic.parameters(), a.grad_clip)
    optimizer.step()
    vf_loss = distributed.all_reduce_sum(loss_total).item()
    return {"vf_loss": vf_loss, "vf_clipfrac": sum(clipfracs) / max(1, len(clipfracs))}
