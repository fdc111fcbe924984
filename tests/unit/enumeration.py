"""A tiny bigram "model" whose every sequence can be enumerated, so J(pi) = sum_x pi(x) r(x), its gradient and the
trainer's expected update are exact, and so is the variance of the trainer's one-sample estimate of it.

Used by the rollout-correction, KL-reading and noise-scale tests, and by bench/rollout_correction.py (the bias and
variance table in docs/trainer.md)."""

from __future__ import annotations

import itertools
import types

import torch

from rollout_farm.services.engine.torch.sampling import processed_logits
from rollout_farm.services.protocol import SamplingParams
from rollout_farm.trainer.algorithms import rollout_correction
from rollout_farm.trainer.algorithms.forward import response_logprobs
from rollout_farm.trainer.batch import Batch
from rollout_farm.trainer.config import RolloutCorrection
from tests.unit.batches import response_batch

BOS = 0


class Bigram(torch.nn.Module):
    """next-token logits = table[previous token]: an HF-style causal LM with V tokens."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())

    def forward(self, input_ids, attention_mask=None):
        return types.SimpleNamespace(logits=self.table[input_ids])


def sequences(V: int, L: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(V), repeat=L)))


def token_logprobs(table: torch.Tensor, xs: torch.Tensor, params: SamplingParams | None) -> torch.Tensor:
    """(N, L) logprob of each token of each sequence under softmax(table / T) (params None: T = 1), or under the
    engine's processed distribution (params: temperature, top-p; -inf outside the nucleus)."""
    prev = torch.cat([torch.full((len(xs), 1), BOS), xs[:, :-1]], 1)
    logits = table[prev]  # (N, L, V)
    if params is not None:
        logits = processed_logits(logits.reshape(-1, logits.shape[-1]), params).reshape(logits.shape)
    return torch.log_softmax(logits, -1).gather(-1, xs[..., None]).squeeze(-1)


def exact_gradient(
    table: torch.Tensor, xs: torch.Tensor, r: torch.Tensor, T: float, support=None, baseline=None
) -> torch.Tensor:
    """sum_x pi_T(x) (r(x) - b) grad log pi_T(x) over the sequences in `support` (default all; over all of them it
    is grad J(pi_T)), b = `baseline` or E_pi[r]."""
    th = table.clone().requires_grad_()
    p = token_logprobs(th / T, xs, None).sum(-1).exp()
    b = (p * r).sum().detach() if baseline is None else baseline
    keep = torch.ones(len(xs), dtype=torch.bool) if support is None else support
    (grad,) = torch.autograd.grad((p * (r - b))[keep].sum(), th)
    return grad


def every_sequence_batch(xs: torch.Tensor, q_tok: torch.Tensor, r: torch.Tensor, T: float) -> Batch:
    """One row per sequence, its per-token sampling logprobs `q_tok` as the service would report them."""
    B, L = xs.shape  # the raw logprobs (0) are not used by the update
    full = torch.ones(B, L, dtype=torch.long)
    return response_batch(full, xs, BOS, sampling_logprobs=q_tok, temperatures=torch.full((B,), T), rewards=r)


def estimator_moments(
    table: torch.Tensor, xs: torch.Tensor, r: torch.Tensor, T: float, q_tok: torch.Tensor, cfg: RolloutCorrection
) -> tuple[torch.Tensor, float]:
    """The trainer's one-sample policy-gradient estimate g(x) = (r(x) - E_q[r]) sum_t w_t(x) grad log pi_T(x_t),
    the weights w from rollout_farm/trainer/algorithms/rollout_correction.py under `cfg`, over x ~ q (per-token
    logprobs `q_tok`): its expectation E_q[g] (to compare with grad J) and its total variance E_q[|g|^2] - |E_q[g]|^2
    (a batch of N samples has 1/N of it)."""
    q = q_tok.sum(-1).exp()
    drawn = torch.nonzero(q > 0).squeeze(-1)
    xs, q_tok, q, r = xs[drawn], q_tok[drawn], q[drawn], r[drawn]
    b = every_sequence_batch(xs, q_tok, r, T)
    model = Bigram(table)
    with torch.no_grad():
        old = response_logprobs(model, b, b.temperatures)[0]
    weights, _, _ = rollout_correction.correction(old, b, cfg)
    lp = response_logprobs(model, b, b.temperatures)[0]
    adv = r - (q * r).sum()
    grads = torch.stack(
        [
            torch.autograd.grad(adv[i] * (weights[i] * lp[i]).sum(), model.table, retain_graph=True)[0]
            for i in range(len(xs))
        ]
    )  # (N, V, V): g(x) for each sequence q can draw
    mean = (q[:, None, None] * grads).sum(0)
    second = (q * grads.flatten(1).pow(2).sum(-1)).sum()
    return mean, (second - mean.pow(2).sum()).item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item()


def spanning_q(tables: list[torch.Tensor], xs: torch.Tensor, switch_at: int, T: float) -> torch.Tensor:
    """Per-token logprobs (N, L) of samples whose tokens before `switch_at` were drawn by tables[0] and the rest by
    tables[1] (a partial rollout that spans a weight push), at temperature T."""
    first, second = (token_logprobs(t / T, xs, None) for t in tables)
    return torch.cat([first[:, :switch_at], second[:, switch_at:]], 1)


def drifted_versions(V: int, drift: float, count: int, seed: int) -> list[torch.Tensor]:
    """`count` successive weight versions of a V x V table, each one `drift` x a standard normal step from the last."""
    g = torch.Generator().manual_seed(seed)
    tables = [torch.randn(V, V, generator=g)]
    for _ in range(count - 1):
        tables.append(tables[-1] + drift * torch.randn(V, V, generator=g))
    return tables
