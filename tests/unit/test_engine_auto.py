"""FARM_ENGINE=auto picks the engine by where it runs and the model's size (engine/auto.py)."""

import sys

from transformers import LlamaConfig

from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.engine.auto import AUTO_VLLM_MIN_PARAMETERS, engine_name, parameter_count


def model_folder(tmp_path, hidden: int, layers: int, vocab: int):
    LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        vocab_size=vocab,
        num_attention_heads=8,
        num_key_value_heads=8,
    ).save_pretrained(tmp_path)
    return str(tmp_path)


def test_auto_takes_vllm_for_a_real_model_on_cpu_and_torch_for_a_toy_or_without_vllm(tmp_path):
    big = model_folder(tmp_path / "big", 1024, 6, 32000)
    toy = model_folder(tmp_path / "toy", 64, 2, 258)
    assert parameter_count(big) >= AUTO_VLLM_MIN_PARAMETERS > parameter_count(toy)
    with_vllm = {"engine": "auto", "device": "cpu", "vllm_python": sys.executable, "api_token": "test-token-auto"}
    assert engine_name(ServiceSettings(**with_vllm, model=big)) == "vllm"
    assert engine_name(ServiceSettings(**with_vllm, model=toy)) == "torch"
    no_vllm = {**with_vllm, "vllm_python": str(tmp_path / "missing" / "python")}
    assert engine_name(ServiceSettings(**no_vllm, model=big)) == "torch"
    assert engine_name(ServiceSettings(**{**with_vllm, "device": "cuda"}, model=big)) == "sglang"
    only_auto = ServiceSettings(engine="torch", model=big, api_token="test-token-auto")
    assert engine_name(only_auto) == "torch"  # only "auto" is resolved
