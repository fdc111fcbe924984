"""The gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A): the batch size, in samples, above which a bigger batch stops paying for itself.

It is estimated from gradients at two batch sizes the actor step already computes: each micro-batch's (small) and
the whole mini-batch's (big). For a batch of b samples, E|G_b|² = |G|² + tr(Σ)/b, so two sizes give both unknowns:

    tr(Σ) = (mean_i |G_i|² - |G_big|²) / (mean_i 1/b_i - 1/B)        |G|² = |G_big|² - tr(Σ)/B

A micro-batch's backward adds only its share of the mini-batch's loss (its tokens or samples over the mini-batch's,
by loss_agg_mode), so its gradient is divided by that share to give the micro-batch's own mean gradient G_i.
Each estimate is noisy; the step's figure is the ratio of the two sums over its mini-batches, as the paper advises.
"""

from __future__ import annotations

import torch


class MicroGradients:
    """Squared norms of each micro-batch's own gradient, from the accumulated .grad before and after its backward."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        self.before = [torch.zeros_like(p) for p in self.params]
        self.sq_norms: list[float] = []  # |G_i|², the micro-batch's mean gradient
        self.sizes: list[int] = []  # b_i, samples

    def record(self, share: float, samples: int) -> None:
        """After micro-batch i's backward: its gradient is .grad minus what was there before, over its share."""
        sq = 0.0
        for p, before in zip(self.params, self.before):
            now = p.grad if p.grad is not None else torch.zeros_like(p)
            sq += float((now - before).pow(2).sum())
            before.copy_(now)
        if share > 0 and samples > 0:
            self.sq_norms.append(sq / share**2)
            self.sizes.append(samples)

    def squared_norm(self) -> float:
        """|G_big|², the mini-batch's gradient as accumulated (call before clipping)."""
        return sum(float(p.grad.pow(2).sum()) for p in self.params if p.grad is not None)


def noise_parts(small_sq: list[float], small_sizes: list[int], big_sq: float, big_size: int) -> tuple[float, float]:
    """(tr(Σ), |G|²) from micro-batch squared gradient norms and sizes and the mini-batch's; (0, 0) when the sizes
    do not differ (one micro-batch per mini-batch measures nothing)."""
    if not small_sq or big_size <= 0:
        return 0.0, 0.0
    inv_small = sum(1 / b for b in small_sizes) / len(small_sizes)
    gap = inv_small - 1 / big_size
    if gap <= 0:
        return 0.0, 0.0
    trace = (sum(small_sq) / len(small_sq) - big_sq) / gap
    return trace, big_sq - trace / big_size


def noise_scale(traces: list[float], g2s: list[float]) -> float | None:
    """B_simple over a step's mini-batches: the ratio of the summed parts; None when |G|² is not positive."""
    g2 = sum(g2s)
    return sum(traces) / g2 if g2 > 0 else None
