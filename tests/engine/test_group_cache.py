"""The group cache (rollout_farm/services/engine/torch/prefill.py, batch.py `fan_out`): the rows of one prompt
share its prefill, and a prompt prefilled before on the same weights is found in the prompt cache. Every sample must
be what the unshared engine (share_prompts=False: each row prefills its own prompt) gives with the same seed, tokens
equal and logprobs within 1e-5, for each kind of sampling the samplers ask of the engine. Counts are the engine's own
counters (engine.stats), never timings."""

import asyncio
import threading

import pytest

from rollout_farm.services.engine.torch import TorchEngine
from rollout_farm.services.engine.torch.batch import Batch
from rollout_farm.services.protocol import SamplingParams

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
OTHER = [30, 31, 32]
KINDS = {  # what the samplers ask of the engine: greedy, seeded temperature with top-k / top-p, a regex, stop strings
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True),
    "temperature": SamplingParams(temperature=0.8, max_new_tokens=8, ignore_eos=True, seed=3),
    "top_k_top_p": SamplingParams(temperature=1.2, top_k=20, top_p=0.9, max_new_tokens=8, ignore_eos=True, seed=4),
    "regex": SamplingParams(temperature=1.0, regex="[0-9a-z ]{1,12}", max_new_tokens=8, seed=5),
    "stop": SamplingParams(temperature=1.0, stop=["e"], max_new_tokens=8, ignore_eos=True, seed=6),
}


@pytest.fixture(scope="module")
def shared(sharp_model):
    return TorchEngine(str(sharp_model), threads=1)


@pytest.fixture(scope="module")
def unshared(sharp_model):
    return TorchEngine(str(sharp_model), threads=1, share_prompts=False)


def counts(engine) -> tuple[int, int]:
    s = engine.stats.snapshot()
    return s["prefill_tokens"], s["prefill_shared_tokens"]


def same(a, b) -> bool:
    return all(
        x.token_ids == y.token_ids and x.logprobs == pytest.approx(y.logprobs, abs=1e-5, nan_ok=True)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_group_prefills_its_prompt_once_and_samples_as_unshared(shared, unshared, kind):
    prompts = [PROMPT] * 6 + [OTHER] * 2  # two groups in one call, as a chunk of a GRPO request
    before = counts(shared)
    a = shared.generate(prompts, KINDS[kind])
    fed, saved = (x - y for x, y in zip(counts(shared), before))
    b = unshared.generate(prompts, KINDS[kind])
    assert same(a, b)
    # fed once each (or only their last token: the prompt cache holds them after the first kind)
    assert fed + saved == 6 * len(PROMPT) + 2 * len(OTHER) and fed <= len(PROMPT) + len(OTHER)
    assert len({tuple(o.token_ids) for o in a}) > 1 or kind == "greedy"  # the rows drew apart


def test_a_broken_fan_out_is_caught(shared, unshared, monkeypatch):
    """Negative control: every row given the cache of the first prompt's row."""
    prompts = [PROMPT] * 2 + [OTHER] * 2
    reference = {kind: unshared.generate(prompts, KINDS[kind]) for kind in ("greedy", "temperature")}
    original = Batch.fan_out
    monkeypatch.setattr(Batch, "fan_out", lambda self, lg, which, *a: original(self, lg, [0] * len(which), *a))
    for kind, expected in reference.items():
        assert not same(shared.generate(prompts, KINDS[kind]), expected)


def test_a_sampler_s_next_round_finds_the_prompt_in_the_prompt_cache(sharp_model, unshared):
    engine = TorchEngine(str(sharp_model), threads=1)
    reference = unshared
    prompt = [40 + i for i in range(12)]
    params = [KINDS["temperature"].model_copy(update={"seed": s}) for s in (1, 2)]
    engine.generate([prompt] * 4, params[0])
    before = counts(engine)
    second = engine.generate([prompt] * 4, params[1])  # round 2: only the last prompt token goes in
    assert tuple(x - y for x, y in zip(counts(engine), before)) == (1, 4 * len(prompt) - 1)
    assert same(second, reference.generate([prompt] * 4, params[1]))
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.stage_weights(state, 1)
    engine.commit_weights(1)
    before = counts(engine)
    engine.generate([prompt] * 4, params[1])  # new weights: the cache is stale, one full prefill
    assert tuple(x - y for x, y in zip(counts(engine), before)) == (len(prompt), 3 * len(prompt))


def test_calls_sharing_a_prompt_join_mid_batch_and_one_is_cancelled(shared, unshared):
    """Two seeded calls of one prompt join a running batch together (one prefill for both); one is cancelled at
    once. The other samples what it samples unshared, and the one cancelled ends "abort"."""
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=24, ignore_eos=True, seed=11)
    long = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    prompt = [60 + i for i in range(9)]

    async def run(engine, cancel_second: bool):
        running = asyncio.ensure_future(engine.agenerate([[7, 8, 9]], long))
        await asyncio.sleep(0.3)  # the long call is decoding
        stop = threading.Event()
        first = asyncio.ensure_future(engine.agenerate([prompt] * 3, params))
        second = asyncio.ensure_future(engine.agenerate([prompt] * 3, params.model_copy(update={"seed": 12}), stop))
        await asyncio.sleep(0)
        if cancel_second:
            stop.set()
        outputs = await first, await second
        running.cancel()
        return outputs

    (a, cancelled), (b, _) = asyncio.run(run(shared, True)), asyncio.run(run(unshared, False))
    assert same(a, b)
    assert all(o.finish_reason in ("abort", "length") for o in cancelled)
