"""SGLang's pause modes on the torch engine's scheduler (rollout_farm/services/engine/torch/hold.py): "in_place" holds
the running rows at a step boundary with their KV cache, "retract" puts them back in the queue to continue from prompt +
tokens so far; a weight commit while held lands at once and the held rows finish on it, their per-token versions
switching where they were held. Held or retracted calls that are cancelled end "abort" with the tokens they had."""

import threading
import time

import pytest

from rollout_farm.services.engine.bench_engine import BenchEngine
from rollout_farm.services.engine.torch import TorchEngine
from rollout_farm.services.errors import EngineVerbMissing
from rollout_farm.services.protocol import SamplingParams
from tests.engine.test_batching import push
from tests.service.helpers import wait_until

LONG = 120
SEEDED = SamplingParams(temperature=1.0, max_new_tokens=LONG, ignore_eos=True, seed=7)
PROMPTS = [[40, 41, 42], [43, 44, 45, 46, 47]]


@pytest.fixture
def engine(tiny_model):
    e = TorchEngine(str(tiny_model), threads=1)
    yield e
    e.resume()


def steps(engine) -> list[int]:
    b = engine.scheduler.batch
    return b.t["step"].tolist() if len(b) else []


def start(engine, params=SEEDED, cancel=None) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(engine.generate(PROMPTS, params, cancel)), daemon=True)
    t.start()
    wait_until(lambda: steps(engine) and min(steps(engine)) >= 5, "the call decoding a few steps")
    return t, out


def assert_prefix(part, whole, k: int):
    assert part.token_ids[:k] == whole.token_ids[:k]
    assert part.logprobs[:k] == pytest.approx(whole.logprobs[:k], abs=1e-4)


def paused_part_way(engine, mode: str, while_paused):
    """PROMPTS sampled alone, then again with the engine paused in `mode` a few steps in, while_paused() run while it
    is paused, and resumed: (the lone outputs, the paused call's, what while_paused returned)."""
    alone = engine.generate(PROMPTS, SEEDED)
    t, out = start(engine)
    engine.pause(mode)
    seen = while_paused()
    engine.resume()
    t.join(120)
    return alone, out[0], seen


def test_in_place_holds_the_rows_and_resume_finishes_them_as_if_never_paused(engine):
    def held_still():
        held = steps(engine)
        assert engine.paused and engine.busy and 0 < min(held) < LONG
        time.sleep(0.3)
        assert steps(engine) == held  # no step while held

    alone, out, _ = paused_part_way(engine, "in_place", held_still)
    for o, a in zip(out, alone):
        assert o.finish_reason == "length" and o.token_ids == a.token_ids
        assert o.logprobs == pytest.approx(a.logprobs, abs=1e-5) and set(o.token_versions) == {0}


def test_in_place_pause_then_a_weight_push_gives_versions_that_switch_where_it_was_held(engine, tiny_model):
    def push_while_held():
        held = steps(engine)
        push(engine, tiny_model, 1, "finish").join(60)  # lands while the rows are held: no wait for them to finish
        assert engine.weight_version == 1 and steps(engine) == held
        return held

    alone, out, held = paused_part_way(engine, "in_place", push_while_held)
    for o, a, k in zip(out, alone, held):
        assert o.finish_reason == "length" and len(o.token_ids) == LONG and o.weight_version == 0
        assert o.token_versions == [0] * k + [1] * (LONG - k)
        assert_prefix(o, a, k)
        assert o.token_ids != a.token_ids  # the rest was sampled on the new weights


def test_retract_requeues_the_rows_and_they_continue_from_the_tokens_so_far(engine):
    def requeued():
        assert not len(engine.scheduler.batch) and not engine.busy and len(engine.scheduler._pending) == 1
        k = len(engine.scheduler._pending[0].carried[0][0])
        assert 0 < k < LONG

    alone, out, _ = paused_part_way(engine, "retract", requeued)
    for o, a in zip(out, alone):  # prefilled again from prompt + tokens, drawing on from the same generator
        assert o.finish_reason == "length" and o.token_ids == a.token_ids
        assert o.logprobs == pytest.approx(a.logprobs, abs=1e-4) and set(o.token_versions) == {0}


def test_retract_then_a_weight_push_continues_on_the_new_version(engine, tiny_model):
    def push_while_retracted():
        ks = [len(c[0]) for c in engine.scheduler._pending[0].carried]
        push(engine, tiny_model, 1, "finish").join(60)
        return ks

    alone, out, ks = paused_part_way(engine, "retract", push_while_retracted)
    for o, a, k in zip(out, alone, ks):
        assert len(o.token_ids) == LONG and o.token_versions == [0] * k + [1] * (LONG - k)
        assert_prefix(o, a, k)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_held_call_that_is_cancelled_ends_abort_with_its_tokens(engine, mode):
    alone = engine.generate(PROMPTS, SEEDED)
    cancel = threading.Event()
    t, out = start(engine, cancel=cancel)
    engine.pause(mode)
    cancel.set()
    t.join(30)
    assert not t.is_alive(), "a cancelled held call returns while the engine stays paused"
    for o, a in zip(out[0], alone):
        assert o.finish_reason == "abort" and 0 < len(o.token_ids) < LONG
        assert_prefix(o, a, len(o.token_ids))
    assert engine.paused


def test_abort_ends_held_rows_with_their_tokens(engine):
    t, out = start(engine)
    engine.pause("in_place")
    engine.abort()
    t.join(30)
    assert not t.is_alive() and all(o.finish_reason == "abort" and o.token_ids for o in out[0])


def test_engines_that_cannot_hold_refuse_the_modes(tiny_model):
    bench = BenchEngine(str(tiny_model), 0.001)
    with pytest.raises(EngineVerbMissing, match="in_place"):
        bench.pause("in_place")
    assert not bench.paused  # refused before closing the gate
