"""Stale and spanning samples are corrected at the sequence level by default
(rollout_farm/trainer/algorithms/stale_samples.py `correct_by_sequence`), and that default is the one that recovers
the policy gradient.

Exact by enumeration (tests/unit/enumeration.py): each sample's first token drawn by weight version 5, the rest by
version 6, the trainer at version 7. The negative control is the old default, token-level weights capped at 2.0,
which the test shows biased (it corrects each token's choice, not its prefix's distribution).

Mutations tried, each failing here: the async default left at token level; the default applied over a config's own
`rollout_is`; the default applied to synchronous configs; the cap left at 2.0; the default applied under top-p.
"""

import pytest
import torch

from rollout_farm.trainer.config import load
from tests.unit.enumeration import drifted_versions, estimator_moments, exact_gradient, sequences, spanning_q

ASYNC = ["async_training.staleness_threshold=2", "trainer.rollout_source=queue"]


def correction(overrides: list[str]):
    return load(None, overrides).algorithm.rollout_correction


def test_stale_samples_get_sequence_weights_unless_the_config_says_otherwise():
    for stale in (ASYNC, ["trainer.queue_max_staleness=1", "trainer.rollout_source=queue"]):
        rc = correction(stale)
        assert (rc.rollout_is, rc.rollout_is_threshold) == ("sequence", 5.0)
    assert correction([]).rollout_is == "token"  # synchronous: verl's default
    own = correction([*ASYNC, "algorithm.rollout_correction.rollout_is=token"])
    assert (own.rollout_is, own.rollout_is_threshold) == ("token", 2.0)
    capped = correction([*ASYNC, "algorithm.rollout_correction.rollout_is_threshold=3.0"])
    assert (capped.rollout_is, capped.rollout_is_threshold) == ("sequence", 3.0)


@pytest.mark.parametrize(
    "truncation", ["actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.sampler_params={top_k: 20}"]
)
def test_under_truncation_the_config_must_choose(truncation):
    """Under top-p or top-k the sequence ratio carries every token's nucleus mass and shrinks long responses'
    weights toward 0: no silent default there; each of the choices the message names is accepted."""
    with pytest.raises(ValueError, match="rollout_is_batch_normalize=true"):
        load(None, [*ASYNC, truncation])
    chosen = [*ASYNC, truncation, "algorithm.rollout_correction.rollout_is=sequence"]
    assert (
        correction([*chosen, "algorithm.rollout_correction.rollout_is_batch_normalize=true"]).rollout_is == "sequence"
    )
    assert correction([*ASYNC, truncation, "algorithm.rollout_correction.rollout_is=token"]).rollout_is == "token"
    assert correction([truncation]).rollout_is == "token"  # synchronous: verl's default, no question


def bias(drift: float, seed: int, rc) -> float:
    V, L = 3, 3
    xs = sequences(V, L)
    v5, v6, v7 = drifted_versions(V, drift, 3, seed)
    r = torch.rand(V**L, generator=torch.Generator().manual_seed(seed + 100)).round()
    truth = exact_gradient(v7, xs, r, 1.0)
    mean, _ = estimator_moments(v7, xs, r, 1.0, spanning_q([v5, v6], xs, 1, 1.0), rc)
    return ((mean - truth).norm() / truth.norm()).item()


@pytest.mark.parametrize("drift, seed", [(0.3, 1), (1.0, 2)])
def test_the_async_default_recovers_the_gradient_of_spanning_samples_and_token_weights_do_not(drift, seed):
    default = bias(drift, seed, correction(ASYNC))
    token = bias(drift, seed, correction([*ASYNC, "algorithm.rollout_correction.rollout_is=token"]))
    assert default < 0.06, default
    assert token > 0.5, token  # the old default: 0.78 and 0.68 here
