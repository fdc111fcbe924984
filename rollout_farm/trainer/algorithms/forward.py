"""Forward passes of the trainer's models on a Batch: the policy's logprobs, the exact KL to the reference, the
critic's values.

The policy the trainer trains is the one it samples from, as in verl: the logits divided by the temperature each
token was drawn at, its sample's, or its turn's in an episode whose sampler changed it between turns
(`actor_rollout_ref.actor.logits_temperature=sampled`). With `none` the logprobs are the raw
model's (temperature 1), and the update on tempered samples optimises the sampler rather than the policy.
"""

from __future__ import annotations

from typing import Callable

import torch

from rollout_farm.trainer.batch import Batch


def response_logits(model: torch.nn.Module, b: Batch) -> torch.Tensor:
    """The raw logits (B, R, V) of each response position's next token."""
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()  # (B, T, V)
    return logits.gather(1, b.response_pos[..., None].expand(-1, -1, logits.shape[-1]))


def tempered_log_softmax(logits: torch.Tensor, temperatures: torch.Tensor | float | None) -> torch.Tensor:
    """log_softmax of (B, R, V) logits divided by each token's temperature (B, R), each sample's (B,), one
    temperature, or none."""
    if isinstance(temperatures, torch.Tensor):
        logits = logits / (temperatures[:, :, None] if temperatures.dim() == 2 else temperatures[:, None, None])
    elif temperatures is not None:
        logits = logits / temperatures
    return torch.log_softmax(logits, -1)


def response_log_softmax(model: torch.nn.Module, b: Batch, temperatures: torch.Tensor | None) -> torch.Tensor:
    """log_softmax (B, R, V) of the distribution over each response position's next token, the logits divided by
    each token's temperature (None: raw)."""
    return tempered_log_softmax(response_logits(model, b), temperatures)


def response_logprobs(
    model: torch.nn.Module, b: Batch, temperatures: torch.Tensor | None = None, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (B, R) of the response tokens, and their entropy (B, R) if asked."""
    logp = response_log_softmax(model, b, temperatures)
    return _token_logprobs(logp, b), (-(logp.exp() * logp).sum(-1) if with_entropy else None)


def exact_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """KL(p || ref) of each position's next-token distribution (B, R): summed over the vocabulary."""
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def policy_and_reference(
    policy: torch.nn.Module,
    ref: torch.nn.Module,
    b: Batch,
    temperatures: torch.Tensor | None,
    kl_temperature: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy's and the reference's logprobs of the response tokens (B, R) at `temperatures`, and the exact
    KL(policy || ref) of each position's next-token distribution (B, R), summed over the vocabulary, not estimated
    from one token: at each sample's own temperature, and at the one `kl_temperature` (None: the same reading).

    The second reading does not move with the sampler: the same weights read 1.4-1.9x higher at T = 0.5 than at
    T = 0.7, so thresholds on the first would shift whenever a sampler changes its temperature."""
    logits, ref_logits = response_logits(policy, b), response_logits(ref, b)
    kl_fixed = None  # read at the samples' temperature when it is kl_temperature already: no second softmax
    if kl_temperature is not None and not at_temperature(temperatures, kl_temperature):
        kl_fixed = exact_kl(*(tempered_log_softmax(x, kl_temperature) for x in (logits, ref_logits)))
    logp, ref_logp = tempered_log_softmax(logits, temperatures), tempered_log_softmax(ref_logits, temperatures)
    del logits, ref_logits
    kl = exact_kl(logp, ref_logp) * b.response_mask
    fixed = kl if kl_fixed is None else kl_fixed * b.response_mask
    return _token_logprobs(logp, b), _token_logprobs(ref_logp, b), kl, fixed


def at_temperature(temperatures: torch.Tensor | None, t: float) -> bool:
    """Whether every sample's logits are divided by t already (None: raw logits, temperature 1)."""
    return t == 1.0 if temperatures is None else bool((temperatures == t).all())


def _token_logprobs(logp: torch.Tensor, b: Batch) -> torch.Tensor:
    return logp.gather(-1, b.response_ids[..., None]).squeeze(-1)


def response_values(critic: torch.nn.Module, b: Batch) -> torch.Tensor:
    """The critic's value (B, R) of the state before each response token (a token-classification head, 1 label)."""
    out = critic(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[..., 0].float()  # (B, T)
    return out.gather(1, b.response_pos) * b.response_mask


def in_micro_batches(fn: Callable[[Batch], tuple | torch.Tensor], b: Batch, size: int | None):
    """fn(batch) -> a (B_i, ...) tensor or a tuple of them, over micro-batches of `size` samples (None: all at
    once), concatenated: no-grad passes of big batches."""
    if not size or size >= len(b):
        return fn(b)
    parts = [fn(b.select(idx)) for idx in torch.arange(len(b)).split(size)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts))
    return torch.cat(parts)


def temperatures(b: Batch, actor) -> torch.Tensor | None:
    """What the policy's logits are divided by (actor_rollout_ref.actor.logits_temperature): each token's
    temperature (B, R), the one its turn was drawn at (a sample's own, unless a sampler changed it between the turns
    of an episode), or None for raw logits."""
    return b.token_temperatures if actor.logits_temperature == "sampled" else None
