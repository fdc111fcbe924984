"""The KL to the reference the trainer reads (controller, rollback guard, the samplers' policy stats) is the exact
one: per response position, summed over the vocabulary (rollout_farm/trainer/algorithms/forward.py:
policy_and_reference)."""

import torch

from rollout_farm.services.protocol import SamplingParams
from rollout_farm.trainer.algorithms.forward import policy_and_reference
from rollout_farm.trainer.batch import Batch
from rollout_farm.trainer.loop import kl_readings
from tests.unit.enumeration import Bigram, every_sequence_batch, sequences, token_logprobs


def every_sequence(xs: torch.Tensor, T: float) -> Batch:
    return every_sequence_batch(xs, torch.zeros(xs.shape), torch.zeros(len(xs)), T)


def expected_readings(policy, ref, xs, T, q) -> dict:
    """Each reading's expectation over sequences drawn from q (probabilities (N,)): kl_readings is a token mean,
    and every sequence here has L tokens, so its expectation is the q-weighted mean of the per-sequence readings."""
    out = {}
    for i in range(len(xs)):
        b = every_sequence(xs[i : i + 1], T)
        with torch.no_grad():
            old, ref_lp, kl, _ = policy_and_reference(policy, ref, b, b.temperatures)
        for k, v in kl_readings(b, old, ref_lp, kl).items():
            out[k] = out.get(k, 0.0) + q[i].item() * v
    return out


def test_the_exact_reading_matches_the_true_kl_and_one_token_estimates_are_biased_on_tempered_samples():
    """pi and ref at T = 0.5: the true KL(pi || ref) per token, by enumeration, against each reading's expectation
    on samples drawn at T = 0.5 with top_p 0.9 (the nucleus skews the prefixes: no reading is exact then, but the
    exact per-position KL is by far the closest) and drawn from pi itself (the exact reading is exact)."""
    V, L, T = 4, 3, 0.5
    g = torch.Generator().manual_seed(1)
    ref_table = torch.randn(V, V, generator=g)
    policy, ref = Bigram(ref_table + 0.3 * torch.randn(V, V, generator=g)), Bigram(ref_table)
    xs = sequences(V, L)
    with torch.no_grad():
        p = token_logprobs(policy.table / T, xs, None).sum(-1)
        r = token_logprobs(ref.table / T, xs, None).sum(-1)
    truth = (p.exp() * (p - r)).sum().item() / L
    on_policy = expected_readings(policy, ref, xs, T, p.exp())
    assert abs(on_policy["kl_ref_before"] - truth) < 1e-5 * truth + 1e-7
    with torch.no_grad():
        q = token_logprobs(policy.table, xs, SamplingParams(temperature=T, top_p=0.9)).sum(-1).exp()
    tempered = expected_readings(policy, ref, xs, T, q)
    error = {k: abs(v - truth) / truth for k, v in tempered.items()}
    assert error["kl_ref_before"] < 0.5 * min(error["kl_k1"], error["kl_k3"]), (truth, tempered)
