"""A rollout batch as tensors: the service's groups, right-padded, and rank 0's batch on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.protocol import Group
from trainer import distributed


@dataclass
class Batch:
    """B samples. T = longest prompt+response, R = longest response."""

    input_ids: torch.Tensor  # (B, T) prompt then response, right-padded
    attention_mask: torch.Tensor  # (B, T)
    response_pos: torch.Tensor  # (B, R) index into logits of the position that predicts response token j
    response_ids: torch.Tensor  # (B, R)
    response_mask: torch.Tensor  # (B, R) 1 on real response tokens
    rollout_logprobs: torch.Tensor  # (B, R) raw-model logprobs reported by the service
    rewards: torch.Tensor  # (B,)
    group_ids: np.ndarray  # (B,) which prompt each sample answers
    weight_versions: list[int]  # (B,) version that generated each sample

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor) -> "Batch":
        return Batch(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.response_pos[idx],
            self.response_ids[idx],
            self.response_mask[idx],
            self.rollout_logprobs[idx],
            self.rewards[idx],
            self.group_ids[idx.cpu().numpy()],
            [self.weight_versions[i] for i in idx.tolist()],
        )

    def to(self, device: torch.device) -> "Batch":
        tensors = (self.input_ids, self.attention_mask, self.response_pos, self.response_ids, self.response_mask)
        tensors += (self.rollout_logprobs, self.rewards)
        return Batch(*(t.to(device) for t in tensors), self.group_ids, self.weight_versions)


def make_batch(groups: list[Group], pad_id: int) -> Batch:
    rows = [(g.prompt_token_ids, s, gi) for gi, g in enumerate(groups) for s in g.samples]
    T = max(len(p) + len(s.token_ids) for p, s, _ in rows)
    R = max(1, max(len(s.token_ids) for _, s, _ in rows))
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    pos = torch.zeros((B, R), dtype=torch.long)
    resp = torch.full((B, R), pad_id, dtype=torch.long)
    mask = torch.zeros((B, R), dtype=torch.long)
    old = torch.zeros((B, R))
    for i, (p, s, _) in enumerate(rows):
        n, m = len(p), len(s.token_ids)
        input_ids[i, : n + m] = torch.tensor(p + s.token_ids)
        attention[i, : n + m] = 1
        pos[i] = torch.arange(n - 1, n - 1 + R).clamp(max=T - 1)
        resp[i, :m] = torch.tensor(s.token_ids, dtype=torch.long)
        mask[i, :m] = 1
        old[i, :m] = torch.tensor(s.logprobs)
    rewards = torch.tensor([s.reward for _, s, _ in rows])
    group_ids = np.array([gi for _, _, gi in rows])
    return Batch(input_ids, attention, pos, resp, mask, old, rewards, group_ids, [s.weight_version for _, s, _ in rows])


def broadcast_batch(b: Batch | None) -> Batch | None:
    """Rank 0's batch on every rank, as plain tensors; None everywhere when rank 0 has none."""
    if not distributed.active():
        return b
    sizes = [len(b), b.input_ids.shape[1], b.response_ids.shape[1]] if b is not None else [0, 0, 0]
    B, T, R = distributed.broadcast_ints(sizes, 3)
    if B == 0:
        return None
    long, shapes = torch.long, [(B, T), (B, T), (B, R), (B, R), (B, R), (B, R), (B,), (B,), (B,)]
    dtypes = [long, long, long, long, long, torch.float32, torch.float32, long, long]
    mine = None
    if b is not None:
        tensors = [b.input_ids, b.attention_mask, b.response_pos, b.response_ids, b.response_mask, b.rollout_logprobs]
        tensors += [b.rewards, torch.as_tensor(b.group_ids), torch.tensor(b.weight_versions)]
        mine = [x.to(d).contiguous() for x, d in zip(tensors, dtypes)]
    t = distributed.broadcast_tensors(mine, shapes, dtypes)
    return Batch(*t[:7], t[7].cpu().numpy(), t[8].tolist())
