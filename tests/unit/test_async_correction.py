"""Stale and spanning samples are corrected at the sequence level by default
(rollout_farm/trainer/algorithms/stale_samples.py `correct_by_sequence`), and that default is the one that recovers
the policy gradient.

Exact by enumeration (tests/unit/enumeration.py): each sample's first token drawn by weight version 5, the rest by
version 6, the trainer at version 7. The negative control is the old default, token-level weights capped at 2.0,
which the test shows biased (it corrects each token's choice, not its prefix's distribution).

Mutations tried, each failing here: the async default left at token level; the default applied over a config's own
`rollout_is`; the default applied to synchronous configs; the cap left at 2.0; the default applied under top-p.
Issue 36, each seen failing: the truncation read from the config alone (the old `min(r.top_p,
sampler_params.top_p)`, not `Sampler.effective`: kl_adaptive_temperature's own top_p 0.9 and the constrained regex
get through); `truncation` ignoring the regex; `refuse_truncated` without its version test (fresh samples refused) or
with correct_by_sequence's `_stale_default = True` line deleted (stale truncated samples accepted).
"""

import pytest
import torch

from rollout_farm.services import protocol as P
from rollout_farm.services.extensions.samplers import Sampler
from rollout_farm.trainer.algorithms.stale_samples import refuse_truncated
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


class TopK(Sampler):
    """A user plug-in sampler (named by its dotted path) that draws from the 20 likeliest tokens."""

    def plan(self, sampling: P.SamplingParams, state) -> tuple[P.SamplingParams, dict]:
        return sampling.model_copy(update={"top_k": 20}), {}


TRUNCATING = {
    "top_p": ["actor_rollout_ref.rollout.top_p=0.9"],
    "kl_adaptive_default_top_p": ["actor_rollout_ref.rollout.sampler=kl_adaptive_temperature"],
    "constrained_regex": [
        "actor_rollout_ref.rollout.sampler=pattern_conditional",
        "actor_rollout_ref.rollout.sampler_params={mode: constrained}",
    ],
    "filter_of_kl_adaptive": [
        "actor_rollout_ref.rollout.sampler=dynamic_group_filter",
        "actor_rollout_ref.rollout.sampler_params={inner: {name: kl_adaptive_temperature}}",
    ],
    "plug_in_top_k": ["actor_rollout_ref.rollout.sampler=tests.unit.test_async_correction:TopK"],
}


@pytest.mark.parametrize("truncation", TRUNCATING.values(), ids=TRUNCATING.keys())
def test_under_truncation_the_config_must_choose(truncation):
    """Under top-p, top-k or a regex, as the sampler draws (its own defaults and plug-ins count), the sequence ratio
    carries every token's kept mass and shrinks long responses' weights toward 0: no silent default there; each of
    the choices the message names is accepted."""
    with pytest.raises(ValueError, match="rollout_is_batch_normalize=true"):
        load(None, [*ASYNC, *truncation])
    chosen = [*ASYNC, *truncation, "algorithm.rollout_correction.rollout_is=sequence"]
    assert (
        correction([*chosen, "algorithm.rollout_correction.rollout_is_batch_normalize=true"]).rollout_is == "sequence"
    )
    assert correction([*ASYNC, *truncation, "algorithm.rollout_correction.rollout_is=token"]).rollout_is == "token"
    assert correction(truncation).rollout_is == "token"  # synchronous: verl's default, no question


def test_samplers_that_do_not_truncate_keep_the_default():
    """Negative controls: pattern_conditional's filter mode and a sampler the trainer cannot import are accepted."""
    for ok in (
        ["actor_rollout_ref.rollout.sampler=pattern_conditional"],
        ["actor_rollout_ref.rollout.sampler=no.such:X"],
    ):
        assert correction([*ASYNC, *ok]).rollout_is == "sequence"


def group(version: int, sampled_with: P.SampledWith) -> P.Group:
    sample = P.Sample(
        token_ids=[5], logprobs=[-1.0], text="x", finish_reason="length", weight_version=version, reward=1.0,
        sampled_with=sampled_with,
    )  # fmt: skip
    return P.Group(prompt_token_ids=[1], samples=[sample], reward_mean=1.0, reward_std=0.0, zero_variance=True)


def test_stale_samples_drawn_with_truncation_are_refused_under_the_default_at_run_time():
    """The backstop (rollout_farm/trainer/sync/rollouts.py pull calls it): a sampler that truncates where the config
    check could not see it (a plug-in not importable in the trainer, a truncation that starts later) sends stale
    samples whose `sampled_with` says so; under the default sequence ratio they are refused. Fresh samples, untruncated
    ones and a config's own choice of the sequence ratio are not."""
    cfg = load(None, ASYNC)
    nucleus, regex = (
        P.SampledWith(temperature=1.0, top_p=0.9, top_k=-1),
        P.SampledWith(temperature=1.0, top_p=1.0, top_k=-1, regex=True),
    )
    for cut in (nucleus, regex):
        with pytest.raises(RuntimeError, match="rollout_is_batch_normalize=true"):
            refuse_truncated(cfg, [group(3, cut)], version=4)
        refuse_truncated(cfg, [group(4, cut)], version=4)  # fresh
    refuse_truncated(cfg, [group(3, P.SampledWith(temperature=0.7, top_p=1.0, top_k=-1))], version=4)
    own = load(None, [*ASYNC, "algorithm.rollout_correction.rollout_is=sequence"])
    refuse_truncated(own, [group(3, nucleus)], version=4)


def test_an_episode_truncated_in_a_later_turn_is_refused_too():
    """An episode's sampled_with is its first turn's: the backstop reads every turn's (sampled_turns). Mutation
    killed, seen failing: `refuse_truncated` reading only `s.sampled_with`."""
    cfg = load(None, ASYNC)
    raw = P.SampledWith(temperature=1.0, top_p=1.0, top_k=-1)
    episode = group(3, raw)
    sample = episode.samples[0]
    sample.token_ids, sample.logprobs = [5, 6], [-1.0, -1.0]
    sample.sampled_turns = [
        P.SampledSpan(start=0, end=1, sampled_with=raw),
        P.SampledSpan(start=1, end=2, sampled_with=P.SampledWith(temperature=0.5, top_p=0.9, top_k=-1)),
    ]
    with pytest.raises(RuntimeError, match="rollout_is_batch_normalize=true"):
        refuse_truncated(cfg, [episode], version=4)
    sample.sampled_turns[1] = P.SampledSpan(start=1, end=2, sampled_with=raw)  # the control: no turn truncates
    refuse_truncated(cfg, [episode], version=4)


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
