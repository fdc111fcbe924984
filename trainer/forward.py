"""Forward passes of the trainer's models on a Batch: the policy's logprobs, the critic's values."""

from __future__ import annotations

from typing import Callable

import torch

from trainer.batch import Batch


def response_logprobs(
    model: torch.nn.Module, b: Batch, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw-model logprobs (B, R) of the response tokens, and their entropy (B, R) if asked."""
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()  # (B, T, V)
    logits = logits.gather(1, b.response_pos[..., None].expand(-1, -1, logits.shape[-1]))  # (B, R, V)
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, b.response_ids[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return lp, entropy


def response_values(critic: torch.nn.Module, b: Batch) -> torch.Tensor:
    """The critic's value (B, R) of the state before each response token (a token-classification head, 1 label)."""
    out = critic(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[..., 0].float()  # (B, T)
    return out.gather(1, b.response_pos) * b.response_mask


def in_micro_batches(fn: Callable[[Batch], torch.Tensor], b: Batch, size: int | None) -> torch.Tensor:
    """fn(batch) -> (B_i, R) tensor, over micro-batches of `size` samples (None: all at once), concatenated:
    no-grad passes of big batches."""
    if not size or size >= len(b):
        return fn(b)
    return torch.cat([fn(b.select(idx)) for idx in torch.arange(len(b)).split(size)])
