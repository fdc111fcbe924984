"""Speculative decoding in the torch engine (rollout_farm/services/engine/torch/draft_step.py): drafts from the engine's
own history, verified in one forward pass. The engine's samples must be the plain engine's: greedy tokens equal and
logprobs within 1e-5; sampled outcomes indistinguishable by a chi-squared test over 10^4 samples, which must tell a
deliberately wrong acceptance rule (accept every draft) apart; stops cut where one token at a time would stop."""

import pytest
import torch
from scipy.stats import chi2_contingency

from rollout_farm.services.engine.torch import TorchEngine
from rollout_farm.services.engine.torch import speculative as torch_speculative
from rollout_farm.services.protocol import SamplingParams

PROMPTS = [[40, 41, 42, 43], [50, 51, 52]]


@pytest.fixture(scope="module")
def plain(sharp_model):
    return TorchEngine(str(sharp_model), threads=1)


@pytest.fixture(scope="module")
def drafting(sharp_model):
    return TorchEngine(str(sharp_model), threads=1, speculative_tokens=4)


def test_greedy_samples_and_logprobs_are_the_plain_engine_s(plain, drafting):
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    expected = plain.generate(PROMPTS * 3, params)
    for _ in range(2):  # the second epoch drafts from the first
        got = drafting.generate(PROMPTS * 3, params)
        for a, b in zip(got, expected, strict=True):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            assert a.sampling_logprobs == b.sampling_logprobs == [0.0] * 24
    s = drafting.stats.snapshot()
    assert s["draft_accepted_tokens"] > 0.5 * s["draft_tokens"] > 0  # greedy repeats itself: most drafts hold
    assert not drafting.history.rows  # every row closed


def outcomes(engine, params, seed: int, rounds: int = 8, rows: int = 1280) -> list[tuple[int, ...]]:
    """The engine's generator seeded (each side its own seeds), so the test gives the same p on every run: an exact
    rule passes, whatever the 1% of seeds a chi-squared test at p > 0.01 would fail by chance."""
    out = []
    for r in range(rounds):
        engine.scheduler.draws.gen.manual_seed(seed * 100 + r)
        out += [tuple(o.token_ids) for o in engine.generate([PROMPTS[0]] * rows, params)]
    return out


def chi2_p(a: list, b: list) -> float:
    keys = sorted(set(a) | set(b))
    table = [[a.count(k) for k in keys], [b.count(k) for k in keys]]
    keep = [i for i in range(len(keys)) if table[0][i] + table[1][i] >= 10]  # sparse cells pooled away
    rest = [sum(r[i] for i in range(len(keys)) if i not in keep) for r in table]
    pooled = [[r[i] for i in keep] for r in table]
    return chi2_contingency([row + [x] for row, x in zip(pooled, rest)] if any(rest) else pooled)[1]


def test_sampled_outcomes_are_the_plain_engine_s_and_a_wrong_rule_is_caught(plain, drafting, monkeypatch):
    """3 tokens at temperature 0.8 with top-k 3 (at most 27 outcomes), 10,240 samples each side, the drafts from the
    samples before (the history of this prompt) and from the running siblings."""
    params = SamplingParams(temperature=0.8, top_k=3, max_new_tokens=3, ignore_eos=True)
    reference = outcomes(plain, params, seed=1)
    before = drafting.stats.snapshot()["draft_tokens"]
    p = chi2_p(outcomes(drafting, params, seed=2), reference)
    assert drafting.stats.snapshot()["draft_tokens"] - before > 1000  # drafts were verified
    assert p > 0.01, p
    monkeypatch.setattr(torch_speculative, "_accepts", lambda u, p_draft: torch.ones_like(u, dtype=torch.bool))
    assert chi2_p(outcomes(drafting, params, seed=3), reference) < 1e-6


def test_stop_strings_and_tokens_cut_where_one_token_at_a_time_would(plain, drafting):
    """The stops are taken from the plain engine's own greedy text, so that they are met mid-draft."""
    free = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    said = plain.generate(PROMPTS, free)[0].token_ids
    stop_id, stop_text = said[6], plain.tokenizer.decode(said[9:11])
    cases = (
        free.model_copy(update={"stop": [stop_text]}),
        free.model_copy(update={"stop_token_ids": [stop_id]}),
        free.model_copy(update={"max_new_tokens": 5}),
    )
    for params in cases:
        expected = plain.generate(PROMPTS * 2, params)
        for _ in range(2):
            got = drafting.generate(PROMPTS * 2, params)
            assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in expected]
        assert expected[0].finish_reason == ("length" if params.max_new_tokens == 5 else "stop")


def test_each_sample_carries_its_drafts_and_the_scrape_has_them_per_sampler(drafting):
    """EngineOutput's draft counts (the replica sums them per sampler: EngineServer._count_drafts) and the
    farm_sampler_draft_tokens series the scrape makes of them."""
    from rollout_farm.services import protocol as P
    from rollout_farm.services.observability import metrics
    from rollout_farm.services.replica.engine_server import EngineServer

    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    drafting.generate(PROMPTS, params)
    outs = drafting.generate(PROMPTS, params)  # its second epoch: drafts
    assert all(0 < o.draft_accepted <= o.draft_tokens for o in outs)
    server = EngineServer.__new__(EngineServer)
    server.drafts = {}
    server._count_drafts("best_of_n", outs)
    server._count_drafts("best_of_n", outs)
    drafted, accepted = 2 * sum(o.draft_tokens for o in outs), 2 * sum(o.draft_accepted for o in outs)
    assert server.drafts == {"best_of_n": [drafted, accepted]}
    state = P.ReplicaState(
        replica="r0", weight_version=0, paused=False, busy=False, generated_tokens=0,
        drafts_by_sampler={"best_of_n": P.DraftCounts(drafted=drafted, accepted=accepted)},
    )  # fmt: skip
    text = metrics.exposition([state], {}, "me").decode()
    assert f'farm_sampler_draft_tokens{{outcome="accepted",replica="r0",sampler="best_of_n"}} {float(accepted)}' in text
