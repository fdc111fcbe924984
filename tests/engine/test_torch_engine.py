"""The torch engine on a tiny random Llama, in process (no Ray)."""

import asyncio
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from rollout_farm.services.engine import EngineOutput, WeightsRejected
from rollout_farm.services.engine.torch import TorchEngine
from rollout_farm.services.extensions.samplers import NoParams, Plain
from rollout_farm.services.protocol import Group, Prompt, Sample, SampledWith, SamplingParams
from rollout_farm.services.replica.group_sampling import sample_groups, to_sample
from rollout_farm.services.weights.state_dict import canonical_state_dict
from rollout_farm.trainer.algorithms.forward import response_logprobs
from rollout_farm.trainer.batch import make_batch


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


def plain_group(engine, prompt: Prompt, n: int, params: SamplingParams) -> Group:
    """One group drawn in process by the replica's code (generate, decode, build the Samples), sampler plain."""

    async def generate(ids, p):
        return engine.generate(ids, p)

    groups = sample_groups(
        generate, engine.tokenizer, [prompt], n, params, None, {"sampler": "plain"}, Plain(NoParams())
    )
    return asyncio.run(groups)[0]


def nucleus_logprobs(logits: torch.Tensor, tokens: list[int], temperature: float, top_p: float) -> list[float]:
    """log q(token) at each row of (T, V) raw logits, q the softmax at `temperature` cut to the smallest set of most
    likely tokens whose mass reaches top_p, renormalised: written out apart from the engine's processed_logits."""
    out = []
    for row, token in zip(logits, tokens):
        probs, order = torch.softmax(row.double() / temperature, -1).sort(descending=True)
        size = int((probs.cumsum(-1) < top_p).sum()) + 1  # the prefix up to the first token that reaches top_p
        assert token in order[:size].tolist()  # the engine sampled inside the nucleus
        out.append(torch.log(probs[order.tolist().index(token)] / probs[:size].sum()).item())
    return out


def test_samples_record_the_distribution_they_were_drawn_from(engine):
    """A Sample's sampling_logprobs are those of the distribution sampled (temperature 0.5, top_p 0.9), recomputed
    with a plain forward pass; its logprobs stay the raw model's; sampled_with names the params. Greedy: None."""
    params = SamplingParams(temperature=0.5, top_p=0.9, max_new_tokens=12, seed=4)
    group = plain_group(engine, Prompt(text="Q: 12+30\nA:"), 3, params)
    prompt = group.prompt_token_ids
    for s in group.samples:
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        raw = torch.log_softmax(logits, -1)[range(len(s.token_ids)), s.token_ids].tolist()
        assert s.sampled_with == SampledWith(temperature=0.5, top_p=0.9, top_k=-1)
        assert s.sampling_logprobs == pytest.approx(nucleus_logprobs(logits, s.token_ids, 0.5, 0.9), abs=1e-4)
        assert s.logprobs == pytest.approx(raw, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(s.sampling_logprobs, s.logprobs)) > 0.1
    greedy = plain_group(engine, Prompt(text="hi"), 1, SamplingParams(temperature=0, max_new_tokens=4)).samples[0]
    assert greedy.sampling_logprobs is None and greedy.sampled_with.temperature == 0


def test_a_token_outside_the_sampled_distribution_leaves_no_sampling_logprobs(engine):
    """A regex constraint can force a token outside the nucleus: its sampling logprob is -inf, which JSON cannot
    carry, so the Sample has none."""
    out = EngineOutput([5, 6], [-1.0, -2.0], "length", 0, [0, 0], sampling_logprobs=[-0.5, float("-inf")])
    params = SamplingParams(temperature=0.5, top_p=0.9)
    assert to_sample(out, engine.tokenizer, Prompt(text="hi"), None, {}, False, params).sampling_logprobs is None


def test_stop_token_ids_end_samples(engine):
    ids = prompts(engine, ["Q: 3+3\nA:"] * 8)
    free = engine.generate(ids, SamplingParams(max_new_tokens=20, seed=5))
    stop = free[0].token_ids[2]  # a token that this seed produces third
    outs = engine.generate(ids, SamplingParams(max_new_tokens=20, seed=5, stop_token_ids=[stop]))
    assert outs[0].token_ids == free[0].token_ids[:3] and outs[0].finish_reason == "stop"
    for o in outs:
        assert stop not in o.token_ids[:-1]


def test_stop_strings_end_samples_in_the_engine_at_the_token_that_completes_them(engine):
    """A sample stops at the token that completes its first stop string and keeps that token: the same draw as
    without the stop up to there (same seed, one row). In a batch, every row either ends right where its text first
    holds the string, or runs to the length limit without it."""
    decode = engine.tokenizer.decode
    one = prompts(engine, ["Q: 3+3\nA:"])
    free = engine.generate(one, SamplingParams(max_new_tokens=24, seed=5, ignore_eos=True))[0]
    text = decode(free.token_ids)
    stop = next(text[i : i + 2] for i in range(3, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    cut = engine.generate(one, SamplingParams(max_new_tokens=24, seed=5, ignore_eos=True, stop=[stop]))[0]
    n = next(k for k in range(1, len(free.token_ids) + 1) if stop in decode(free.token_ids[:k]))
    assert cut.token_ids == free.token_ids[:n] < free.token_ids and cut.finish_reason == "stop"
    batch = engine.generate(one * 6, SamplingParams(max_new_tokens=24, seed=9, ignore_eos=True, stop=[stop, "Q"]))
    for o in batch:
        hit = [s for s in (stop, "Q") if s in decode(o.token_ids)]
        assert o.finish_reason == ("stop" if hit else "length")
        assert not any(s in decode(o.token_ids[:-1]) for s in (stop, "Q"))  # it ended at the first occurrence


def test_score_gives_each_tokens_logprob_and_the_top_alternatives_like_a_forward_pass(engine):
    seqs = prompts(engine, ["Q: 12+3\nA: 15", "hi there"])
    scored = engine.score(seqs, top_k=3)
    for ids, s in zip(seqs, scored):
        with torch.no_grad():
            logp = torch.log_softmax(engine.model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        assert s.logprobs[0] is None and s.top[0] == []
        expected = logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()
        assert s.logprobs[1:] == pytest.approx(expected, abs=1e-5)
        for alts, row in zip(s.top[1:], logp):
            assert [t for t, _ in alts] == row.topk(3).indices.tolist()
            assert [lp for _, lp in alts] == pytest.approx(row.topk(3).values.tolist(), abs=1e-5)


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
    assert not result  # paused: not admitted (a check of nothing happening: the sleep cannot make it fail)
    engine.resume()
    t.join(120)  # a hang bound, not a timing check
    assert len(result) == 1

    long = SamplingParams(max_new_tokens=4000, seed=0, stop_token_ids=[])
    eos = set(engine.eos_ids)
    engine.served.eos_ids = set()  # no EOS, so only the abort can end this early
    try:
        t = threading.Thread(target=lambda: result.append(engine.generate(ids * 4, long)))
        t.start()
        while t.is_alive():  # abort until it lands inside the running call
            time.sleep(0.2)
            engine.abort()
        t.join(60)
    finally:
        engine.served.eos_ids = eos
    aborted = result[-1]
    assert all(o.finish_reason == "abort" and len(o.token_ids) < 4000 for o in aborted)


def test_health_generates_a_token(engine):
    assert 0 <= engine.health() < len(engine.tokenizer)
