"""The torch engine keeps a session's KV cache between turns (rollout_farm/services/engine/torch/session_cache.py): a
turn whose prompt extends the session's last sequence prefills only its new tokens and the last sampled one, and samples
what it would sample from a full prefill. Prefill counts are the engine's own counters (engine.stats), never timings."""

import asyncio
import threading

import pytest

from rollout_farm.services.engine.torch import TorchEngine
from rollout_farm.services.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture
def engine(tiny_model):
    # without the prompt cache (test_group_cache.py): a repeated first turn would otherwise be its hit
    return TorchEngine(str(tiny_model), threads=1, prompt_cache_bytes=0)


def prefilled(engine) -> tuple[int, int]:
    s = engine.stats.snapshot()
    return s["prefill_tokens"], s["session_cache_tokens"]


def turns(engine, key: str | None, new: list[list[int]]):
    """A session of len(new) turns: each prompt is the last prompt, its sample and the new ids. Per turn: the
    output, the prompt, and the prefill counters' increase (fed, reused)."""
    prompt, out = [], []
    for ids in new:
        prompt = prompt + [t for o in out[-1:] for t in o.token_ids] + ids
        before = prefilled(engine)
        (o,) = engine.generate([prompt], GREEDY, cache_key=key)
        after = prefilled(engine)
        out.append(o)
        yield o, list(prompt), (after[0] - before[0], after[1] - before[1])


NEW = [[40, 41, 42, 43, 44], [50, 51], [60, 61, 62], [70]]


def test_a_turn_prefills_only_its_new_tokens_and_samples_the_same(engine):
    plain = list(turns(engine, None, NEW))
    cached = list(turns(engine, "s1", NEW))
    for (a, _, _), (b, _, _) in zip(plain, cached):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    for k, (out, prompt, (fed, reused)) in enumerate(cached):
        if k == 0:
            assert (fed, reused) == (len(prompt), 0)
        else:
            assert fed == len(NEW[k]) + 1 <= len(NEW[k]) + 1  # the new tokens and the last sampled one
            assert reused == len(prompt) - fed
    assert all(reused == 0 for *_, (_, reused) in plain)  # no key, no cache


def test_no_reuse_after_a_fork_a_weight_commit_or_eviction(engine):
    list(turns(engine, "s2", NEW[:2]))
    before = prefilled(engine)
    (o,) = engine.generate([[40, 41, 99, 98]], GREEDY, cache_key="s2")  # not an extension: a fork
    assert prefilled(engine)[1] == before[1] and prefilled(engine)[0] - before[0] == 4
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.stage_weights(state, engine.weight_version + 1)
    engine.commit_weights(engine.weight_version + 1)
    before = prefilled(engine)
    engine.generate([[40, 41, 99, 98] + o.token_ids + [5]], GREEDY, cache_key="s2")
    assert prefilled(engine)[1] == before[1]  # the cache was computed on the old weights
    engine.forget_session("s2")
    assert len(engine.session_kv) == 0


def test_the_cache_stays_within_its_bytes(tiny_model):
    small = TorchEngine(str(tiny_model), threads=1, session_cache_bytes=60_000)
    for key in ("a", "b", "c", "d"):
        small.generate([[40 + i for i in range(30)]], GREEDY, cache_key=key)
    assert 0 < len(small.session_kv) < 4 and small.session_kv.bytes <= 60_000
    assert "d" in small.session_kv._entries  # the most recent stays


def test_a_cached_turn_joins_a_running_batch_and_samples_the_same(engine):
    reference = list(turns(engine, None, NEW[:2]))
    list(turns(engine, "s3", NEW[:1]))  # the cache of turn 0

    async def run():
        long = asyncio.ensure_future(
            engine.agenerate([[7, 8, 9]], SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True))
        )
        await asyncio.sleep(0.3)  # the long call is decoding
        prompt = reference[1][1]
        before = prefilled(engine)
        (o,) = await engine.agenerate([prompt], GREEDY, threading.Event(), cache_key="s3")
        after = prefilled(engine)
        await long
        return o, after[1] - before[1]

    out, reused = asyncio.run(run())
    assert reused > 0 and out.token_ids == reference[1][0].token_ids
