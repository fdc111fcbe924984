"""The trainer trains the distribution that sampled: exact expected updates on a tiny vocabulary.

Every sequence of a tiny bigram "model" (V tokens, L steps) is enumerated, so J(pi) = sum_x pi(x) r(x) and its
gradient are exact, and so is the expected update: the trainer's own loss (trainer/forward.py, rollout_correction.py,
losses.ppo_loss at ratio 1) on a batch holding every sequence the sampler can draw, each advantage weighted by the
sequence's probability q(x) under the sampler (the engine's own processed_logits: temperature, top-p).
"""

import itertools
import types

import torch

from services.engine.torch_engine import processed_logits
from services.protocol import SamplingParams
from trainer import losses, rollout_correction
from trainer.batch import Batch
from trainer.config import RolloutCorrection
from trainer.forward import response_logprobs

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


def expected_update(
    table: torch.Tensor,
    xs: torch.Tensor,
    r: torch.Tensor,
    T: float,
    q_tok: torch.Tensor,
    scale_logits: bool,
    rollout_is: str | None,
) -> torch.Tensor:
    """E_q[the trainer's update direction] with advantages r - E_q[r]: the gradient of minus the trainer's loss on
    a batch of every sequence q can draw, each advantage times q(x)."""
    q = q_tok.sum(-1).exp()
    drawn = torch.nonzero(q > 0).squeeze(-1)
    xs, q_tok, q, r = xs[drawn], q_tok[drawn], q[drawn], r[drawn]
    B, L = xs.shape
    ids = torch.cat([torch.full((B, 1), BOS), xs], 1)
    b = Batch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_pos=torch.arange(L).repeat(B, 1),
        response_ids=xs,
        response_mask=torch.ones(B, L, dtype=torch.long),
        rollout_logprobs=torch.zeros(B, L),  # raw logprobs: not used by the update
        sampling_logprobs=q_tok,  # what the service reports: logprobs under the distribution that sampled
        sampling_known=torch.ones(B, dtype=torch.long),
        temperatures=torch.full((B,), T),
        importance_weights=torch.ones(B),
        rewards=r,
        group_ids=torch.zeros(B, dtype=torch.long),
        weight_versions=torch.zeros(B, dtype=torch.long),
    )
    model = Bigram(table)
    temps = b.temperatures if scale_logits else None
    with torch.no_grad():
        old = response_logprobs(model, b, temps)[0]
    cfg = RolloutCorrection(rollout_is=rollout_is, rollout_is_threshold=1e9)  # no truncation: the exact ratio
    weights, mask, _ = rollout_correction.correction(old, b, cfg)
    adv = (q * (r - (q * r).sum()) * B * L)[:, None].expand(-1, L)  # token-mean: 1 / (B L) per token
    loss, _ = losses.ppo_loss(old, response_logprobs(model, b, temps)[0], adv, mask, weights=weights)
    (grad,) = torch.autograd.grad(-loss, model.table)
    return grad


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item()


def test_at_temperature_0_5_and_top_p_0_9_the_update_follows_the_policy_gradient_and_raw_logits_do_not():
    """Three tokens, three steps, 0/1 rewards. pi is the policy the trainer trains and samples from,
    softmax(logits / T), as in verl. The nucleus drops 12 of the 27 sequences, yet with the logits divided by T and
    the truncation weighted, the expected update is aligned with grad J(pi); with raw logits and no weights (the
    correction off) it is not."""
    V, L, T = 3, 3, 0.5
    g = torch.Generator().manual_seed(26)
    table, r = torch.randn(V, V, generator=g), torch.rand(V**L, generator=g).round()
    xs = sequences(V, L)
    q_tok = token_logprobs(table, xs, SamplingParams(temperature=T, top_p=0.9))
    assert int((q_tok.sum(-1) == float("-inf")).sum()) == 12
    truth = exact_gradient(table, xs, r, T)
    for level in ("token", "sequence"):
        assert cosine(expected_update(table, xs, r, T, q_tok, True, level), truth) >= 0.99
    off = expected_update(table, xs, r, T, q_tok, scale_logits=False, rollout_is=None)
    assert cosine(off, truth) < 0.96


def test_sequence_importance_weights_make_the_update_exact_on_the_samplers_support_under_top_p_truncation():
    """Four tokens, T = 0.5, top_p 0.9: the nucleus drops tokens, so q(x) = pi_T(x) / prod_t pi_T(nucleus_t).
    The sequence-level ratio pi_T / q makes the expected update exactly the policy gradient over the sequences q can
    draw (no weight can bring back what is never sampled); token-level weights come close; none is off."""
    V, L, T = 4, 2, 0.5
    g = torch.Generator().manual_seed(3)
    table, r = torch.randn(V, V, generator=g), torch.rand(V**L, generator=g)
    xs = sequences(V, L)
    q_tok = token_logprobs(table, xs, SamplingParams(temperature=T, top_p=0.9))
    support = q_tok.sum(-1) > float("-inf")
    assert 0 < int((~support).sum())  # the nucleus does truncate here
    baseline = (q_tok.sum(-1).exp() * r).sum()  # the estimator's: E_q[r]
    truth = exact_gradient(table, xs, r, T, support, baseline)
    seq = expected_update(table, xs, r, T, q_tok, True, "sequence")
    token = expected_update(table, xs, r, T, q_tok, True, "token")
    none = expected_update(table, xs, r, T, q_tok, True, None)
    scale = truth.norm()
    assert (seq - truth).norm() / scale < 0.05 * (none - truth).norm() / scale
    assert (token - truth).norm() < (none - truth).norm()
    assert (none - truth).norm() / scale > 0.01


def test_version_lag_is_corrected_by_the_sequence_ratio():
    """Samples from an older policy (another table), full support: the sequence ratio recovers grad J(pi) exactly,
    and without it the update is that of the old policy."""
    V, L, T = 3, 2, 0.7
    g = torch.Generator().manual_seed(5)
    table, r = torch.randn(V, V, generator=g), torch.rand(V**L, generator=g)
    old_table = table + 0.5 * torch.randn(V, V, generator=g)
    xs = sequences(V, L)
    q_tok = token_logprobs(old_table / T, xs, None)
    truth = exact_gradient(table, xs, r, T)
    seq = expected_update(table, xs, r, T, q_tok, True, "sequence")
    none = expected_update(table, xs, r, T, q_tok, True, None)
    assert torch.allclose(seq, truth, atol=1e-5 * truth.abs().max())
    assert cosine(none, truth) < cosine(seq, truth) - 1e-3


def test_the_mismatch_is_logged_and_masked_is_zeroes_tokens_outside_its_bounds():
    B, L = 4, 3
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]] * B))
    sampled = old.clone()
    sampled[0, 0] = torch.log(torch.tensor(0.05))  # ratio 10 on one token
    b = Batch(
        input_ids=torch.zeros(B, L + 1, dtype=torch.long),
        attention_mask=torch.ones(B, L + 1, dtype=torch.long),
        response_pos=torch.arange(L).repeat(B, 1),
        response_ids=torch.zeros(B, L, dtype=torch.long),
        response_mask=torch.ones(B, L, dtype=torch.long),
        rollout_logprobs=old.clone(),
        sampling_logprobs=sampled,
        sampling_known=torch.tensor([1, 1, 1, 0]),
        temperatures=torch.ones(B),
        importance_weights=torch.tensor([1.0, 3.0, 1.0, 1.0]),
        rewards=torch.zeros(B),
        group_ids=torch.tensor([0, 0, 1, 1]),
        weight_versions=torch.zeros(B, dtype=torch.long),
    )
    w, mask, m = rollout_correction.correction(old, b, RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0))
    assert w[0, 0] == 2.0  # truncated at 2, times its importance weight 1
    assert w[1, 0] == 3.0 and w[3, 0] == 1.0  # the importance weight as sent; unknown sampling: no correction
    assert 0 < m["rollout_corr/rollout_is_ratio_fraction_high"] < 0.1  # 1 token of 9 known ones past the cap
    assert m["rollout_corr/unknown_fraction"] == 0.25 and m["rollout_corr/kl"] < 0
    masked = RolloutCorrection(rollout_is="token", rollout_is_threshold="0.5_5.0")
    w, _, _ = rollout_correction.correction(old, b, masked)
    assert w[0, 0] == 0 and w[0, 1] == 1.0  # IcePop: a ratio outside the bounds gets weight 0
