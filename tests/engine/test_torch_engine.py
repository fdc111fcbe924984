"""The torch engine on a tiny random Llama, in process (no Ray)."""

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from services.engine import WeightsRejected
from services.engine.state_dict import canonical_state_dict
from services.engine.torch_engine import TorchEngine
from services.protocol import Group, Sample, SamplingParams
from trainer.batch import make_batch
from trainer.forward import response_logprobs


@pytest.fixture(scope="module")
def engine(tiny_model):
    return TorchEngine(str(tiny_model), threads=1)


def prompts(engine, texts):
    return [engine.tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def test_generate_shapes_and_reasons(engine):
    outs = engine.generate(
        prompts(engine, ["Q: 1+2\nA:", "a much longer prompt, to force left padding"]),
        SamplingParams(max_new_tokens=7, seed=0),
    )
    assert len(outs) == 2
    for o in outs:
        assert 1 <= len(o.token_ids) <= 7 and len(o.logprobs) == len(o.token_ids)
        assert all(lp <= 0 for lp in o.logprobs)
        assert o.finish_reason == ("stop" if o.token_ids[-1] in engine.eos_ids else "length")


def test_seed_reproduces_and_greedy_is_top_k_1(engine):
    ids = prompts(engine, ["Q: 5-3\nA:"] * 4)
    a = engine.generate(ids, SamplingParams(max_new_tokens=12, seed=7))
    b = engine.generate(ids, SamplingParams(max_new_tokens=12, seed=7))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) > 1  # different samples within one batch
    greedy = engine.generate(ids[:1], SamplingParams(temperature=0, max_new_tokens=12))
    top1 = engine.generate(ids[:1], SamplingParams(temperature=1.3, top_k=1, max_new_tokens=12, seed=3))
    assert greedy[0].token_ids == top1[0].token_ids


def test_logprobs_match_a_plain_forward_pass(engine):
    """Engine logprobs (left-padded, KV cache) equal the trainer's recomputation (right-padded, no cache)."""
    ids = prompts(engine, ["Q: 12+30\nA:", "hi", "Q: 99-98\nA: The"])
    outs = engine.generate(ids, SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=10, seed=1))
    groups = [
        Group(
            prompt_token_ids=p,
            samples=[
                Sample(
                    token_ids=o.token_ids, logprobs=o.logprobs, text="", finish_reason=o.finish_reason, weight_version=0
                )
            ],
            reward_mean=0,
            reward_std=0,
            zero_variance=True,
        )
        for p, o in zip(ids, outs)
    ]
    batch = make_batch(groups, engine.pad_id)
    with torch.no_grad():
        lp, _ = response_logprobs(engine.model, batch)
    diff = (lp - batch.rollout_logprobs).abs() * batch.response_mask
    assert diff.max().item() < 1e-4


def test_stop_token_ids_end_samples(engine):
    ids = prompts(engine, ["Q: 3+3\nA:"] * 8)
    free = engine.generate(ids, SamplingParams(max_new_tokens=20, seed=5))
    stop = free[0].token_ids[2]  # a token that this seed produces third
    outs = engine.generate(ids, SamplingParams(max_new_tokens=20, seed=5, stop_token_ids=[stop]))
    assert outs[0].token_ids == free[0].token_ids[:3] and outs[0].finish_reason == "stop"
    for o in outs:
        assert stop not in o.token_ids[:-1]


def test_finished_rows_leave_the_batch_without_changing_the_others(engine):
    """Rows that stop early are dropped from the batch (and its KV cache): the rest decode as they would alone."""
    ids = prompts(engine, ["Q: 3+3\nA:", "a much longer prompt, to force left padding", "hi", "Q: 71-5\nA: The"])
    free = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=16))
    stop = free[0].token_ids[1]  # ends row 0 after two tokens, and the others wherever they produce it
    batch = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[stop]))
    alone = [
        engine.generate([p], SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[stop]))[0] for p in ids
    ]
    assert len(batch[0].token_ids) == 2 and any(
        len(o.token_ids) > 2 for o in batch
    )  # rows did finish at different steps
    for b, a in zip(batch, alone):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        assert max(abs(x - y) for x, y in zip(b.logprobs, a.logprobs)) < 1e-4


def stage_and_commit(engine, state: dict, version: int) -> None:
    """What a one-replica push does: both phases at once."""
    engine.stage_weights(state, version)
    engine.commit_weights(version)


def test_update_weights_checks_names_shapes_dtypes(engine, tiny_model):
    state = load_file(tiny_model / "model.safetensors")
    bad_shape = dict(state, **{"lm_head.weight": torch.zeros(3, 3)})
    bad_dtype = {k: v.half() if k == "lm_head.weight" else v for k, v in state.items()}
    missing = {k: v for k, v in state.items() if k != "lm_head.weight"}
    for bad, words in [(bad_shape, "shape"), (bad_dtype, "dtype"), (missing, "missing")]:
        with pytest.raises(WeightsRejected, match=words):
            stage_and_commit(engine, bad, engine.weight_version + 1)
    before = engine.weight_version
    stage_and_commit(engine, {k: v + 0.01 for k, v in state.items()}, before + 1)
    assert engine.weight_version == before + 1
    assert torch.allclose(canonical_state_dict(engine.model)["lm_head.weight"], state["lm_head.weight"] + 0.01)
    with pytest.raises(WeightsRejected, match="not newer"):
        stage_and_commit(engine, state, before + 1)
    stage_and_commit(engine, state, before + 2)  # back to the file's weights for other tests


def test_pause_resume_abort(engine):
    ids = prompts(engine, ["Q: 1+1\nA:"])
    engine.pause()
    result = []
    t = threading.Thread(target=lambda: result.append(engine.generate(ids, SamplingParams(max_new_tokens=4, seed=0))))
    t.start()
    time.sleep(0.3)
    assert not result  # paused: not admitted
    engine.resume()
    t.join(10)
    assert len(result) == 1

    long = SamplingParams(max_new_tokens=4000, seed=0, stop_token_ids=[])
    eos = set(engine.eos_ids)
    engine.eos_ids = set()  # no EOS, so only the abort can end this early
    try:
        t = threading.Thread(target=lambda: result.append(engine.generate(ids * 4, long)))
        t.start()
        while t.is_alive():  # abort until it lands inside the running call
            time.sleep(0.2)
            engine.abort()
        t.join(60)
    finally:
        engine.eos_ids = eos
    aborted = result[-1]
    assert all(o.finish_reason == "abort" and len(o.token_ids) < 4000 for o in aborted)


def test_health_generates_a_token(engine):
    assert 0 <= engine.health() < len(engine.tokenizer)
