"""Batched LoRA in the torch engine: a row on an adapter samples exactly what the base model with that adapter merged
into its weights samples (logprobs within 1e-5 in float32), whatever else shares its batch; pins keep an adapter
resident while a call uses it; misfits are refused naming the field. On the tiny random Llama as it is (its sharpened
copy's large activations put float32 rounding between the two orders of summation at about 2e-5)."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout_farm.services.adapters.peft_format import AdapterInvalid, read_folder
from rollout_farm.services.engine.base import AdapterNotResident
from rollout_farm.services.engine.torch.engine import TorchEngine
from rollout_farm.services.protocol import SamplingParams
from tests.adapters import adapter_tensors, peft_adapter

PROMPTS = [[1, 5, 9, 2], [3, 3, 7], [8, 1, 4, 4, 2]]
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_new_tokens=8),
    "seeded": SamplingParams(temperature=1.0, max_new_tokens=8, seed=7),
    "top_k_p": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=8, seed=3),
    "regex": SamplingParams(temperature=1.0, max_new_tokens=6, seed=5, regex="[a-z ]*"),
}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {name: peft_adapter(tiny_model, root / name, seed=seed, scale=0.5) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def engine(tiny_model, adapters):
    e = TorchEngine(str(tiny_model), batch_window_s=0.05)
    for name, folder in adapters.items():
        config, _ = read_folder(folder)
        e.stage_adapter(f"{name}@v1", config, adapter_tensors(folder))
        e.commit_adapter(f"{name}@v1")
    return e


@pytest.fixture(scope="module")
def merged(tiny_model, adapters, tmp_path_factory):
    """Per adapter, an engine on the base model with the adapter merged into its weights by peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for name, folder in adapters.items():
        path = tmp_path_factory.mktemp(f"merged-{name}")
        PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model), folder
        ).merge_and_unload().save_pretrained(path)
        AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
        out[name] = TorchEngine(str(path))
    return out


@pytest.mark.parametrize("kind", PARAMS)
def test_mixed_batch_rows_equal_the_merged_model(engine, merged, kind):
    params = PARAMS[kind]
    results = {}

    def run(key):
        results[key] = engine.generate(PROMPTS, params, adapter=key)

    # three calls at once (one batch window): rows of both adapters and of the base decode together
    threads = [threading.Thread(target=run, args=(k,)) for k in ("a@v1", "b@v1", None)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    base = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in results[None]] == [o.token_ids for o in base]
    for name in ("a", "b"):
        want = merged[name].generate(PROMPTS, params)
        got = results[f"{name}@v1"]
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
    # not one policy: the adapters' rows differ from each other and from the base's
    assert [o.token_ids for o in results["a@v1"]] != [o.token_ids for o in results["b@v1"]]
    assert [o.token_ids for o in results["a@v1"]] != [o.token_ids for o in base]


def test_a_pinned_adapter_stays_until_its_call_ends(engine, adapters):
    config, _ = read_folder(adapters["a"])
    engine.stage_adapter("a@v9", config, adapter_tensors(adapters["a"]))
    engine.commit_adapter("a@v9")
    engine.served.lora.pin("a@v9")  # a call in flight
    engine.retire_adapter("a@v9")
    assert "a@v9" not in engine.resident_adapters()  # no new call may use it
    with pytest.raises(AdapterNotResident):
        engine.generate(PROMPTS[:1], PARAMS["greedy"], adapter="a@v9")
    assert "a@v9" in engine.served.lora.adapters  # but the running one still has it
    engine.served.lora.unpin("a@v9")
    assert "a@v9" not in engine.served.lora.adapters


def test_an_adapter_that_does_not_fit_is_refused_naming_the_field(engine, adapters):
    config, _ = read_folder(adapters["a"])
    tensors = adapter_tensors(adapters["a"])
    wide = {k: torch.zeros(v.shape[0], v.shape[1] + 1) if "lora_A" in k else v for k, v in tensors.items()}
    with pytest.raises(AdapterInvalid) as e:
        engine.stage_adapter("a@v10", config, wide)
    assert e.value.problems[0]["field"] == "adapter_model" and "shape" in e.value.problems[0]["message"]
    assert "a@v10" not in engine.resident_adapters()
