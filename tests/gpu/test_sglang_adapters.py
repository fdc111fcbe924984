"""SGLang on a GPU: a LoRA adapter pushed to the engine (stage, commit) samples what the base model with the adapter
merged into its weights computes. The tokens the adapter's calls sample are scored, teacher-forced, by an engine
serving the merged model (SGLang's input_token_logprobs): the logprobs agree within float16's rounding, while the
base model's differ by far more. Then the verbs around it: retire (refused at once, unloaded, its folder deleted), a
mixed batch (base and adapter rows together), and a misfit refused before SGLang sees it.
tests/unit/test_sglang_adapters.py checks the same verbs on a stand-in for SGLang, without a GPU."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.adapters import adapter_tensors, peft_adapter

PROMPTS = [[40, 41, 42, 43], [50, 60, 70], [33, 34, 35, 36, 37]]
TOLERANCE = 0.02  # float16: the adapter's separate matmuls and the merged weights round differently
TARGETS = ("q_proj", "v_proj", "down_proj")


def scored(engine, sequence: list[int], adapter: str | None = None) -> list[float]:
    """The logprob of each token of `sequence` after the first, teacher-forced (SGLang's input_token_logprobs)."""

    async def run():
        return await engine.llm.async_generate(
            input_ids=sequence,
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            return_logprob=True,
            logprob_start_len=0,
            lora_path=adapter,
        )

    result = engine._loop.run_until_complete(run())
    return [lp for lp, _, _ in result["meta_info"]["input_token_logprobs"][1:]]


def generated(engine, adapter: str | None = None):
    from rollout_farm.services.protocol import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    return engine.generate(PROMPTS, params, adapter=adapter)


@pytest.mark.gpu
def test_an_adapter_on_sglang_samples_what_the_merged_model_computes(tmp_path):
    pytest.importorskip("sglang", reason="needs the sglang extra: pip install 'rollout-farm[sglang]'")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_farm.services.adapters.peft_format import AdapterInvalid, LoraConfig, read_folder
    from rollout_farm.services.engine.base import AdapterNotResident
    from rollout_farm.services.engine.sglang_engine import SGLangEngine
    from rollout_farm.services.models import tiny_llama

    base = tiny_llama(tmp_path / "base", hidden=256, layers=2, seed=0)  # head_dim 64: SGLang's kernels support it
    folder = peft_adapter(base, tmp_path / "adapter", seed=1, r=4, alpha=8.0, targets=TARGETS, scale=0.1)
    merged = tmp_path / "merged"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder).merge_and_unload().save_pretrained(
        merged
    )
    AutoTokenizer.from_pretrained(base).save_pretrained(merged)
    config, _ = read_folder(folder)

    engine = SGLangEngine(
        str(base), "cuda", "float16", mem_fraction_static=0.4, max_lora_rank=8, lora_target_modules=TARGETS
    )
    try:
        engine.stage_adapter("a@v1", config, adapter_tensors(folder))
        assert engine.resident_adapters() == {}  # staged: loaded in SGLang, named by no call yet
        engine.commit_adapter("a@v1")
        assert list(engine.resident_adapters()) == ["a@v1"]
        on_adapter, on_base = generated(engine, "a@v1"), generated(engine)
        assert [o.token_ids for o in on_adapter] != [o.token_ids for o in on_base]
        # the adapter's tokens, scored by the base model: far from what the adapter's calls reported
        base_scores = [scored(engine, p + o.token_ids)[len(p) - 1 :] for p, o in zip(PROMPTS, on_adapter)]
        effect = max(abs(a - b) for o, s in zip(on_adapter, base_scores) for a, b in zip(o.logprobs, s))
        assert effect > 5 * TOLERANCE, effect

        # a mixed batch: base and adapter rows decode together and each gets its own model
        async def mixed():
            from rollout_farm.services.protocol import SamplingParams

            params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
            return await asyncio.gather(
                engine.agenerate(PROMPTS, params, adapter="a@v1"), engine.agenerate(PROMPTS, params)
            )

        mixed_adapter, mixed_base = asyncio.run(mixed())
        for lone, batched in ((on_adapter, mixed_adapter), (on_base, mixed_base)):
            for a, b in zip(lone, batched):
                n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
                assert n > 0 and max(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])) < TOLERANCE

        # a misfit is refused before SGLang sees it: rank above the launch's
        with pytest.raises(AdapterInvalid, match="adapter_config.r"):
            wide = peft_adapter(base, tmp_path / "wide", seed=2, r=16, alpha=16.0, targets=TARGETS)
            engine.stage_adapter("wide@v1", LoraConfig(16, 16.0), adapter_tensors(wide))

        # retire: refused at once, unloaded by SGLang, its folder deleted
        staged_folder = engine._adapters.resident["a@v1"].folder
        engine.retire_adapter("a@v1")
        with pytest.raises(AdapterNotResident):
            generated(engine, "a@v1")
        deadline = time.monotonic() + 60
        while engine._adapters.unloading and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not staged_folder.exists()
        with pytest.raises(ValueError, match="a@v1"):  # SGLang holds it no more (and cannot load it again)
            scored(engine, PROMPTS[0], "a@v1")
    finally:
        engine.llm.shutdown()

    reference = SGLangEngine(str(merged), "cuda", "float16", mem_fraction_static=0.4)
    try:
        for p, o in zip(PROMPTS, on_adapter):
            want = scored(reference, p + o.token_ids)[len(p) - 1 :]
            error = max(abs(a - b) for a, b in zip(o.logprobs, want))
            assert error < TOLERANCE, (error, o.logprobs, want)
    finally:
        reference.llm.shutdown()
