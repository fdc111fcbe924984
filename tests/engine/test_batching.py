"""Concurrent generate calls share the torch engine's batches (rollout_farm/services/engine/torch/scheduler.py), and
each call gets what it would get alone: calls are merged by pausing the engine, submitting them, and resuming (they are
admitted together), or by submitting one while another runs (it joins at a step boundary). That they shared decode steps
is read from the engine's own counters (engine.stats), never from timings."""

import asyncio
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from rollout_farm.services.engine.torch import TorchEngine
from rollout_farm.services.protocol import SamplingParams
from tests.service.helpers import wait_until

# tokens: long enough that the other calls join and leave while it runs, and a commit lands in it; the margin is
# 1000 steps (over a second) after the test sees it run, so what is left to chance is a stall of the test's thread that
# long. 4 * LONG fits the tiny model's context.
LONG = 1000


@pytest.fixture(scope="module")
def engine(tiny_model):
    return TorchEngine(str(tiny_model), threads=1)


@pytest.fixture
def fresh_engine(tiny_model):
    """An engine of its own, for the tests that push weights."""
    return TorchEngine(str(tiny_model), threads=1)


def ids(engine, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False).input_ids


def most_calls_in_a_step(engine) -> int:
    """The most generate calls that shared one decode step of this engine."""
    return engine.stats.snapshot()["batch_calls"]["max"]


def together(engine, calls: list[tuple[list[list[int]], SamplingParams]], cancels=None):
    """Run the calls admitted at once (submitted while paused, then resumed); their outputs."""

    async def run():
        engine.pause()
        tasks = [
            asyncio.ensure_future(engine.agenerate(p, s, cancels[i] if cancels else None))
            for i, (p, s) in enumerate(calls)
        ]
        await asyncio.sleep(0)  # each task ran to its first await: agenerate queued its call (no timing involved)
        engine.resume()
        return await asyncio.gather(*tasks)

    return asyncio.run(run())


def assert_same(merged, alone):
    for m, a in zip(merged, alone):
        assert m.token_ids == a.token_ids and m.finish_reason == a.finish_reason
        assert m.token_versions == a.token_versions and m.weight_version == a.weight_version
        assert m.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert m.sampling_logprobs == pytest.approx(a.sampling_logprobs, abs=1e-4)


def mixed_calls(engine) -> list[tuple[list[list[int]], SamplingParams]]:
    return [
        ([ids(engine, "Q: 1+2\nA:"), ids(engine, "a longer prompt, for left padding")], SamplingParams(temperature=0)),
        ([ids(engine, "abc")] * 3, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=20, seed=5)),
        ([ids(engine, "Q: 33-2\nA:")], SamplingParams(temperature=1.3, top_k=5, max_new_tokens=9, seed=11)),
        ([ids(engine, "x")] * 2, SamplingParams(temperature=0, max_new_tokens=30, stop=["a"], ignore_eos=True)),
        ([ids(engine, "hi")] * 2, SamplingParams(temperature=0.9, max_new_tokens=16, seed=2, stop_token_ids=[70])),
        ([ids(engine, "n")], SamplingParams(temperature=0.8, max_new_tokens=12, seed=3, regex=r"[0-9]{1,4}")),
    ]


def test_calls_with_different_params_in_one_batch_get_what_each_gets_alone(fresh_engine):
    engine = fresh_engine
    calls = mixed_calls(engine)
    alone = [engine.generate(p, s) for p, s in calls]
    assert most_calls_in_a_step(engine) == 1
    merged = together(engine, calls)
    assert most_calls_in_a_step(engine) == len(calls)  # they shared decode steps
    for m, a in zip(merged, alone):
        assert_same(m, a)
    reasons = {o.finish_reason for out in merged for o in out}
    assert {"stop", "length"} <= reasons  # rows ended at different steps, for different reasons


def test_a_seeded_call_draws_the_same_whatever_it_is_batched_with(engine):
    seeded = ([ids(engine, "Q: 5-3\nA:")] * 4, SamplingParams(temperature=1.0, max_new_tokens=24, seed=7))
    first = together(engine, [seeded, *mixed_calls(engine)[:2]])[0]
    second = together(engine, [*mixed_calls(engine)[3:], seeded])[-1]
    third = together(engine, [(seeded[0][:1], SamplingParams(temperature=1.0, max_new_tokens=24)), seeded])[-1]
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == [o.token_ids for o in third]
    assert len({tuple(o.token_ids) for o in first}) > 1  # the call's rows still differ from each other


def test_a_call_joins_a_running_batch_at_a_step_boundary_and_both_decode_as_alone(fresh_engine):
    engine = fresh_engine
    long = ([ids(engine, "long one")], SamplingParams(temperature=0, max_new_tokens=LONG, ignore_eos=True))
    late = ([ids(engine, "a prompt much longer than the first one, to pad the batch")] * 2, SamplingParams(seed=9))
    alone_long, alone_late = engine.generate(*long), engine.generate(*late)
    out = []
    t = threading.Thread(target=lambda: out.append(engine.generate(*long)))
    t.start()
    wait_until(lambda: engine.busy, "the long call running")
    joined = engine.generate(*late)
    assert t.is_alive()  # the late call ended while the long one ran
    t.join(120)
    assert most_calls_in_a_step(engine) == 2
    assert_same(out[0], alone_long)
    assert_same(joined, alone_late)


def test_a_cancelled_call_leaves_the_batch_and_the_others_finish(fresh_engine):
    engine = fresh_engine
    params = SamplingParams(temperature=0, max_new_tokens=LONG, ignore_eos=True)
    calls = [([ids(engine, t)], params) for t in ("one", "two", "three")]
    alone = [engine.generate(*c) for c in calls]
    cancels = [threading.Event() for _ in calls]
    steps = engine.stats.snapshot()["decode_steps"]

    def cancel_after_some_steps():
        wait_until(lambda: engine.stats.snapshot()["decode_steps"] > steps + 10, "ten steps of the merged calls")
        cancels[1].set()

    threading.Thread(target=cancel_after_some_steps, daemon=True).start()
    merged = together(engine, calls, cancels)
    assert most_calls_in_a_step(engine) == 3
    cut = merged[1][0]
    assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < LONG
    assert cut.token_ids == alone[1][0].token_ids[: len(cut.token_ids)]
    assert_same(merged[0], alone[0])
    assert_same(merged[2], alone[2])


def test_abort_ends_the_running_calls_not_the_ones_that_come_after(engine):
    params = SamplingParams(temperature=0, max_new_tokens=LONG, ignore_eos=True)
    out = []
    t = threading.Thread(target=lambda: out.append(together(engine, [([ids(engine, "a")], params)] * 2)))
    t.start()
    wait_until(lambda: engine.busy, "the calls running")
    engine.abort()
    t.join(120)
    assert [o.finish_reason for call in out[0] for o in call] == ["abort", "abort"]
    after = engine.generate([ids(engine, "a")], SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))
    assert after[0].finish_reason == "length" and len(after[0].token_ids) == 5


def test_batches_hold_at_most_max_batch_size_rows(tiny_model):
    small = TorchEngine(str(tiny_model), threads=1, max_batch_size=2)
    p = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    outs = together(small, [([ids(small, "q")], p)] * 3 + [([ids(small, "r")] * 3, p)])
    assert [len(o.token_ids) for out in outs for o in out] == [6] * 6
    assert small.stats.snapshot()["batch_rows"]["max"] == 3  # the call larger than the limit, alone; never more


def test_health_and_score_answer_while_a_long_batch_runs(engine):
    params = SamplingParams(temperature=0, max_new_tokens=4 * LONG, ignore_eos=True)
    t = threading.Thread(target=lambda: engine.generate([ids(engine, "long")] * 2, params))
    t.start()
    wait_until(lambda: engine.busy, "the long call running")
    assert 0 <= engine.health() < len(engine.tokenizer)
    assert engine.score([ids(engine, "Q: 1+1")], top_k=2)[0].logprobs[0] is None
    assert t.is_alive()  # both answered before the batch ended
    engine.abort()
    t.join(120)


def push(engine, tiny_model, version: int, policy: str) -> threading.Thread:
    """Stage perturbed weights as `version` and commit them with `policy` from another thread (as the replica
    does); the committing thread."""
    torch.manual_seed(version)
    state = {k: v + 0.1 * torch.randn_like(v) for k, v in load_file(tiny_model / "model.safetensors").items()}
    engine.stage_weights(state, version)
    t = threading.Thread(target=engine.commit_weights, args=(version, policy))
    t.start()
    return t


def run_long_calls(engine) -> tuple[threading.Thread, threading.Thread, list]:
    """Two greedy calls decoding LONG tokens, the second joining the first after a few steps."""
    params = SamplingParams(temperature=0, max_new_tokens=LONG, ignore_eos=True)
    out: list = [None, None]

    def call(i, text):
        out[i] = engine.generate([ids(engine, text)], params)[0]

    first = threading.Thread(target=call, args=(0, "first"))
    first.start()
    wait_until(lambda: engine.busy, "the first call running")
    time.sleep(0.1)  # a few steps
    second = threading.Thread(target=call, args=(1, "second, later"))
    second.start()
    wait_until(lambda: most_calls_in_a_step(engine) == 2, "the second call joining")
    return first, second, out


def test_policy_partial_switches_every_running_call_at_the_same_step(fresh_engine, tiny_model):
    first, second, out = run_long_calls(fresh_engine)
    push(fresh_engine, tiny_model, 1, "partial").join(60)
    first.join(120), second.join(120)
    switches = []
    for o in out:
        assert len(o.token_ids) == LONG and o.finish_reason == "length" and o.weight_version == 0
        v = o.token_versions
        assert v[0] == 0 and v[-1] == 1 and v == sorted(v)
        switches.append(LONG - v.count(1))  # tokens each generated before the switch
    assert switches[0] > switches[1]  # the second call joined later, and both switched at one step
    assert fresh_engine.weight_version == 1


def test_policy_abort_ends_every_running_call_on_the_old_version_and_serves_the_new_one(fresh_engine, tiny_model):
    first, second, out = run_long_calls(fresh_engine)
    commit = push(fresh_engine, tiny_model, 1, "abort")
    first.join(120), second.join(120), commit.join(60)
    for o in out:
        assert o.finish_reason == "abort" and 0 < len(o.token_ids) < LONG
        assert o.weight_version == 0 and set(o.token_versions) == {0}
    assert fresh_engine.weight_version == 1  # served before the aborted calls returned: the replica reruns them


def test_policy_finish_waits_for_the_running_calls_and_holds_new_ones_for_the_new_version(fresh_engine, tiny_model):
    first, second, out = run_long_calls(fresh_engine)
    commit = push(fresh_engine, tiny_model, 1, "finish")
    wait_until(lambda: fresh_engine.scheduler._commit == "finish", "the commit waiting for the running calls")
    later = fresh_engine.generate([ids(fresh_engine, "x")], SamplingParams(temperature=0, max_new_tokens=3))[0]
    first.join(120), second.join(120), commit.join(60)
    for o in out:
        assert o.finish_reason == "length" and len(o.token_ids) == LONG and set(o.token_versions) == {0}
    assert later.weight_version == 1 and set(later.token_versions) <= {1}  # held back until the commit
