"""Mini-batches of whole groups for the PPO epochs, this rank's share of each, and its micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from rollout_farm.trainer.batch import Batch


@dataclass
class MiniBatch:
    idx: torch.Tensor  # this rank's samples of the mini-batch (indices into the step's batch); may be empty
    # {"batch_num_tokens", "global_batch_size"} of the whole mini-batch (each rank's loss is its share), and
    # seq-mean-token-sum-norm's constant divisor "loss_scale_factor"
    share: dict


def mini_batches(
    b: Batch, size: int, rank: int = 0, world: int = 1, loss_scale_factor: int | None = None
) -> Iterator[MiniBatch]:
    """One epoch: the batch's groups in a random order (torch's RNG), cut into mini-batches of `size` groups.
    Every rank sees each whole mini-batch and trains every world-th group of it. Its counts leave out samples with
    no response tokens (a response the rollout correction rejected whole counts as none). `loss_scale_factor`
    goes to verl's agg_loss as it is: without it, seq-mean-token-sum-norm divides by the batch's padded width,
    which changes from step to step (verl pads to the response limit, a constant)."""
    group_ids = b.group_ids.cpu()
    for chunk in torch.randperm(int(group_ids.max()) + 1).split(size):
        whole = torch.isin(group_ids, chunk).to(b.response_mask.device)
        idx = torch.nonzero(torch.isin(group_ids, chunk[rank::world])).squeeze(-1)
        tokens = b.response_mask[whole].sum(-1)
        share = {"batch_num_tokens": max(1, int(tokens.sum())), "global_batch_size": max(1, int((tokens > 0).sum()))}
        yield MiniBatch(idx, share | ({"loss_scale_factor": loss_scale_factor} if loss_scale_factor else {}))


def updates_per_epoch(groups: int, size: int) -> int:
    """Optimizer steps per PPO epoch over `groups` groups in mini-batches of `size` groups."""
    return -(-groups // size)


def micro_batches(idx: torch.Tensor, size: int | None) -> tuple[torch.Tensor, ...]:
    """idx in pieces of `size` samples (None: one piece); none when idx is empty."""
    return idx.split(size or max(1, len(idx))) if len(idx) else ()
