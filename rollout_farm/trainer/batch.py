"""A rollout batch as tensors: the service's groups, right-padded, and rank 0's batch on every rank."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from rollout_farm.services.protocol import Group
from rollout_farm.trainer import distributed


@dataclass
class Batch:
    """B samples. T = longest prompt+response, R = longest response."""

    input_ids: torch.Tensor  # (B, T) prompt then response, right-padded
    attention_mask: torch.Tensor  # (B, T)
    response_pos: torch.Tensor  # (B, R) index into logits of the position that predicts response token j
    response_ids: torch.Tensor  # (B, R)
    response_mask: torch.Tensor  # (B, R) 1 on the response tokens trained: sampled ones (a sample's loss_mask)
    rollout_logprobs: torch.Tensor  # (B, R) raw-model (temperature 1) logprobs reported by the service
    # (B, R) logprobs under the distribution each token was drawn from (logits / T, top-k/top-p renormalised);
    # where the service could not report them (greedy samples, SGLang), the raw ones and sampling_known 0
    sampling_logprobs: torch.Tensor
    sampling_known: torch.Tensor  # (B,) 1 where sampling_logprobs came from the service
    temperatures: torch.Tensor  # (B,) the temperature each sample was drawn at (1 for greedy or unknown)
    importance_weights: torch.Tensor  # (B,) the sampler's importance_weight (1 for samplers that set none)
    rewards: torch.Tensor  # (B,)
    group_ids: torch.Tensor  # (B,) which prompt each sample answers
    weight_versions: torch.Tensor  # (B,) version that generated each sample (its first, oldest token)
    # (B, R) version of each response token (0 on padding): they differ within a sample when a weight commit with
    # the in-flight policy "partial" landed while it was generated. None: every token the sample's weight_version
    token_versions: torch.Tensor | None = None
    # (B, R) the temperature each response token was drawn at: a multi-turn sample's turns may differ (a sampler
    # changed it between them); context and padding have their sample's. None: every token its sample's temperature
    token_temperatures: torch.Tensor | None = None

    def __post_init__(self):
        if self.token_versions is None:
            self.token_versions = self.weight_versions[:, None] * self.response_mask.to(self.weight_versions.device)
        if self.token_temperatures is None:
            self.token_temperatures = self.temperatures[:, None].expand(-1, self.response_mask.shape[1]).contiguous()

    @property
    def oldest_versions(self) -> torch.Tensor:
        """(B,) the oldest version among each sample's response tokens (its weight_version when it has none)."""
        big = torch.iinfo(torch.long).max
        masked = torch.where(self.response_mask.bool().cpu(), self.token_versions, big)
        oldest = masked.min(dim=1).values
        return torch.where(oldest == big, self.weight_versions, torch.minimum(oldest, self.weight_versions))

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name)[idx.to(getattr(self, f.name).device)] for f in fields(self)})

    def to(self, device: torch.device) -> "Batch":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name in ON_DEVICE})

    @property
    def groups(self) -> np.ndarray:
        """group_ids as numpy, as verl's estimators take them."""
        return self.group_ids.cpu().numpy()


ON_DEVICE = {f.name for f in fields(Batch)} - {"group_ids", "weight_versions", "token_versions"}
FLOATS = {
    "rollout_logprobs",
    "sampling_logprobs",
    "temperatures",
    "importance_weights",
    "rewards",
    "token_temperatures",
}


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
    versions = torch.zeros((B, R), dtype=torch.long)
    raw, sampled, temps = torch.zeros((B, R)), torch.zeros((B, R)), torch.ones((B, R))
    for i, (p, s, _) in enumerate(rows):
        n, m = len(p), len(s.token_ids)
        input_ids[i, : n + m] = torch.tensor(p + s.token_ids)
        attention[i, : n + m] = 1
        pos[i] = torch.arange(n - 1, n - 1 + R).clamp(max=T - 1)
        resp[i, :m] = torch.tensor(s.token_ids, dtype=torch.long)
        mask[i, :m] = torch.tensor(s.loss_mask, dtype=torch.long) if s.loss_mask is not None else 1
        versions[i, :m] = torch.tensor(s.token_weight_versions or [s.weight_version] * m, dtype=torch.long)
        raw[i, :m] = torch.tensor(s.logprobs)
        sampled[i, :m] = torch.tensor(s.sampling_logprobs if s.sampling_logprobs is not None else s.logprobs)
        temps[i] = sample_temperature(s.sampled_with)
        for turn in s.sampled_turns or []:
            temps[i, turn.start : turn.end] = sample_temperature(turn.sampled_with)
    samples = [s for _, s, _ in rows]
    return Batch(
        input_ids,
        attention,
        pos,
        resp,
        mask,
        raw,
        sampled,
        sampling_known=torch.tensor([sampling_q_known(s) for s in samples], dtype=torch.long),
        temperatures=torch.tensor([sample_temperature(s.sampled_with) for s in samples]),
        importance_weights=torch.tensor([float(s.sampler_meta.get("importance_weight", 1.0)) for s in samples]),
        rewards=torch.tensor([s.reward for s in samples]),
        group_ids=torch.tensor([gi for _, _, gi in rows]),
        weight_versions=torch.tensor([s.weight_version for s in samples]),
        token_versions=versions,
        token_temperatures=temps,
    )


def raw_is_q(s) -> bool:
    """Whether the sample's raw logprobs are those of the distribution it was drawn from: temperature 1, no top-p,
    no top-k and no regex constraint, in every turn of a multi-turn sample (then an engine that reports no sampling
    logprobs, SGLang, still gives the trainer q)."""
    drawn = [t.sampled_with for t in s.sampled_turns] if s.sampled_turns else [s.sampled_with]
    return all(w is not None and w.raw_is_q() for w in drawn)


def sampling_q_known(s) -> bool:
    """Whether the batch knows the logprobs the sample was drawn with: reported, or equal to the raw ones."""
    return s.sampling_logprobs is not None or raw_is_q(s)


def sample_temperature(w) -> float:
    """The temperature of a draw's params (SampledWith); 1 for greedy draws and when the service did not say."""
    t = w.temperature if w is not None else 1.0
    return t if t > 0 else 1.0


def broadcast_batch(b: Batch | None) -> Batch | None:
    """Rank 0's batch on every rank, as plain tensors; None everywhere when rank 0 has none."""
    if not distributed.active():
        return b
    sizes = [len(b), b.input_ids.shape[1], b.response_ids.shape[1]] if b is not None else [0, 0, 0]
    B, T, R = distributed.broadcast_ints(sizes, 3)
    if B == 0:
        return None
    names = [f.name for f in fields(Batch)]
    shape = {"input_ids": (B, T), "attention_mask": (B, T)}
    shapes = [shape.get(n, (B, R) if n in PER_TOKEN else (B,)) for n in names]
    dtypes = [torch.float32 if n in FLOATS else torch.long for n in names]
    mine = None
    if b is not None:
        mine = [getattr(b, n).to(d).contiguous() for n, d in zip(names, dtypes)]
    return Batch(*distributed.broadcast_tensors(mine, shapes, dtypes))


PER_TOKEN = {
    "response_pos",
    "response_ids",
    "response_mask",
    "rollout_logprobs",
    "sampling_logprobs",
    "token_versions",
    "token_temperatures",
}
