"""The trainer trains the distribution that sampled: exact expected updates on a tiny vocabulary.

Every sequence of a tiny bigram "model" (V tokens, L steps) is enumerated, so J(pi) = sum_x pi(x) r(x) and its
gradient are exact, and so is the expected update: the trainer's own loss (rollout_farm/trainer/algorithms/forward.py,
rollout_correction.py, losses.ppo_loss at ratio 1) on a batch holding every sequence the sampler can draw, each
advantage weighted by the sequence's probability q(x) under the sampler (the engine's own processed_logits: temperature,
top-p).

Mutations tried, each failing a test here: no importance weights at all (`correction` returning the mask: caught
by the first test's errors, which its cosines alone missed at 0.9987); the weights dropped from the loss
(`losses.ppo_loss` passing none to verl). No division by the temperature in training is caught by
test_tempered_logprobs.py; the stale-sample defaults by test_async_correction.py.
"""

import torch

from rollout_farm.services.protocol import SamplingParams
from rollout_farm.trainer.algorithms import losses, rollout_correction
from rollout_farm.trainer.algorithms.forward import response_logprobs
from rollout_farm.trainer.config import RolloutCorrection
from tests.unit.batches import response_batch
from tests.unit.enumeration import Bigram, cosine, every_sequence_batch, exact_gradient, sequences, token_logprobs


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
    b = every_sequence_batch(xs, q_tok, r, T)  # q_tok: what the service reports for each token
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


def error(update: torch.Tensor, truth: torch.Tensor) -> float:
    return ((update - truth).norm() / truth.norm()).item()


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
    # the cosine alone cannot tell the weights' part: with the logits divided by T and no weights it is 0.9987 too.
    # The error can: the sequence ratio takes it from 0.166 to 0.049; the token ratios from 0.1660 to 0.1654
    # (they correct each token's truncation, not the prefixes')
    unweighted = error(expected_update(table, xs, r, T, q_tok, True, None), truth)
    assert error(expected_update(table, xs, r, T, q_tok, True, "sequence"), truth) < 0.5 * unweighted
    assert error(expected_update(table, xs, r, T, q_tok, True, "token"), truth) < unweighted


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
    b = response_batch(
        torch.ones(B, L, dtype=torch.long),
        rollout_logprobs=old.clone(),
        sampling_logprobs=sampled,
        sampling_known=torch.tensor([1, 1, 1, 0]),
        importance_weights=torch.tensor([1.0, 3.0, 1.0, 1.0]),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )
    w, mask, m = rollout_correction.correction(old, b, RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0))
    assert w[0, 0] == 2.0  # truncated at 2, times its importance weight 1
    assert w[1, 0] == 3.0 and w[3, 0] == 1.0  # the importance weight as sent; unknown sampling: no correction
    assert 0 < m["rollout_corr/rollout_is_ratio_fraction_high"] < 0.1  # 1 token of 9 known ones past the cap
    assert m["rollout_corr/unknown_fraction"] == 0.25 and m["rollout_corr/kl"] < 0
    masked = RolloutCorrection(rollout_is="token", rollout_is_threshold="0.5_5.0")
    w, _, _ = rollout_correction.correction(old, b, masked)
    assert w[0, 0] == 0 and w[0, 1] == 1.0  # IcePop: a ratio outside the bounds gets weight 0
