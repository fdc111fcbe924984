"""A regex-constrained draw reports the logprob of the distribution it was drawn from: the processed distribution
(temperature, top-k, top-p) restricted to the tokens the regex allows, renormalised
(rollout_farm/services/engine/torch/sampling.py `draw` and `RegexMask.log_allowed_mass`). The trainer's importance ratio
divides by it, so a q off by 1/Z_allowed would scale every constrained token's weight (`pattern_conditional` in
`constrained` mode).

The real byte tokenizer of the tests' tiny Llama, the engine's own draw; the logits are random. The negative
control is the unconstrained q (what was reported before): its probabilities over the allowed tokens do not sum
to 1 and the draws reject it.

Mutations tried, each failing here: log Z left out of the sampling logprob, in the plain step or in the
draft-verifying one; Z summed over the first allowed token only (the picked one).

Seeded: the logits and the draws come from fixed-seed generators, so the chi-squared p is the same on every run."""

import math
import types

import pytest
import torch
from scipy import stats
from transformers import AutoTokenizer

from rollout_farm.services.engine.torch.sampling import Group, RegexMask, draw
from rollout_farm.services.engine.torch.speculative import verify

DRAWS = 600


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def constrained_draws(tok, top_k: int, speculative: bool = False):
    """DRAWS rows with the same random logits, a digit forced at the start of the text: the tokens drawn, their
    reported sampling logprobs, and the processed logprobs (B, V) they were drawn from. `speculative`: through the
    draft-verifying step (speculative.verify, regex rows get no drafts) instead of the plain one."""
    V = len(tok)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0)).repeat(DRAWS, 1) * 0.5
    mask = RegexMask("[0-9]+", tok, {tok.eos_token_id})
    group = Group(list(range(DRAWS)), torch.Generator().manual_seed(1), mask)
    group.texts = [[] for _ in range(DRAWS)]
    t, k, p = torch.full((DRAWS,), 0.8), torch.full((DRAWS,), top_k), torch.ones(DRAWS)
    if speculative:
        none = torch.zeros(DRAWS, dtype=torch.long)
        v = verify(logits[:, None], none[:, None][:, :0], none, t, k, p, [group], tok.pad_token_id)
        d = types.SimpleNamespace(token=v.tokens[:, 0], sampling_logprob=v.sampling_logprob[:, 0])
    else:
        d = draw(logits, t, k, p, [group], tok.pad_token_id)
    proc = torch.log_softmax(logits[0] / 0.8, -1)
    if top_k > 0:
        proc = torch.where(proc >= proc.topk(top_k).values[-1], proc, -math.inf).log_softmax(-1)
    return d, proc, mask


@pytest.mark.parametrize(
    "top_k, speculative", [(-1, False), (130, False), (-1, True)]
)  # 130: half the vocabulary, some digits outside
def test_the_constrained_draw_reports_the_restricted_distribution(tok, top_k, speculative):
    d, proc, mask = constrained_draws(tok, top_k, speculative)
    allowed = [t for t in range(len(tok)) if mask.allowed([], t)]
    digits = [t for t in allowed if tok.decode([t]).isdigit()]
    assert set(d.token.tolist()) <= set(allowed) and len(digits) == 10  # the digits (and specials, which add no text)
    assert len(set(d.token.tolist())) >= 3
    log_z = torch.logsumexp(proc[allowed], 0)
    assert log_z < -1.0  # the digits hold little of the mass: the correction matters
    expected = proc[d.token] - log_z
    assert torch.allclose(d.sampling_logprob, expected, atol=1e-4)
    q = {t: math.exp(proc[t] - log_z) for t in allowed}
    assert sum(q.values()) == pytest.approx(1.0, abs=1e-5)
    reported = {t: math.exp(lp) for t, lp in zip(d.token.tolist(), d.sampling_logprob.tolist())}
    assert sum(reported[t] for t in reported) <= 1.0 + 1e-5
    counts = torch.bincount(d.token, minlength=len(tok))[allowed].float()
    expected_counts = torch.tensor([q[t] for t in allowed]) * DRAWS
    big = expected_counts >= 5  # chi-square cells; the rare digits pooled into one
    pooled = expected_counts[~big].sum() > 0
    observed = torch.cat([counts[big], counts[~big].sum()[None]]) if pooled else counts[big]
    wanted = torch.cat([expected_counts[big], expected_counts[~big].sum()[None]]) if pooled else expected_counts[big]
    assert stats.chisquare(observed, wanted).pvalue > 1e-3


def test_negative_control_the_unconstrained_q_is_not_the_distribution_drawn(tok):
    d, proc, _ = constrained_draws(tok, -1)
    unconstrained = proc[d.token]
    assert (d.sampling_logprob - unconstrained).min() > 1.0  # q was under-reported by 1/Z
    distinct = dict(zip(d.token.tolist(), unconstrained.tolist()))
    assert sum(math.exp(v) for v in distinct.values()) < 0.5  # not a distribution over what was drawn


def test_a_tiny_allowed_mass_is_still_exact_once_every_token_is_checked(tok):
    """The allowed tokens 12 nats below the rest: Z ~ 1e-6, under the float rounding of 1 - (the mass checked).
    Every token of the byte vocabulary is checked, so log Z is exact, not NaN (a mutant measuring the unchecked
    mass as 1 - a float32 running sum returned NaN here)."""
    mask = RegexMask("[0-9]+", tok, {tok.eos_token_id})
    proc = torch.randn(len(tok), generator=torch.Generator().manual_seed(2))
    allowed = [t for t in range(len(tok)) if mask.allowed([], t)]
    proc[torch.tensor(allowed)] -= 12.0
    expected = torch.logsumexp(torch.log_softmax(proc.double(), -1)[allowed], 0).item()
    assert expected < -10
    assert mask.log_allowed_mass([], proc) == pytest.approx(expected, abs=1e-6)
