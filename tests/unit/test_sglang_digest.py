"""The SGLang engine's base digest (rollout_farm/services/engine/sglang_digest.py): the digest of what SGLang was told
to load equals the torch engine's of the same weights (so a LoRA trainer's read-your-writes check passes on either
engine), follows each base push, and is unknown after an NCCL push. SGLang itself needs a GPU: the engine runs on a
stand-in for sglang.Engine's weight verbs (they only answer ok; the digest never asks SGLang)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_farm.services.adapters.digest import base_digest, tensor_checksums
from rollout_farm.services.engine.sglang_adapters import LoraLaunch
from rollout_farm.services.engine.sglang_digest import folder_digest
from rollout_farm.services.engine.sglang_engine import SGLangEngine
from rollout_farm.services.models import tiny_llama
from rollout_farm.services.weights.state_dict import canonical_state_dict


class WeightVerbs:
    """sglang.Engine's weight updates as they answer when they succeed: (ok, message)."""

    def __init__(self):
        self.updates = []

    def update_weights_from_tensor(self, named_tensors):
        self.updates.append("tensor")
        return True, "ok"

    def update_weights_from_disk(self, path):
        self.updates.append(path)
        return True, "ok", 0

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name):
        self.updates.append("nccl")
        return True, "ok"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("m") / "tiny", hidden=32, layers=2, seed=3)


def torch_engine_digest(folder, dtype=torch.float32) -> str:
    """The digest the torch engine stamps for the folder's model served in `dtype` (TorchModel._digest)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return base_digest(*tensor_checksums(canonical_state_dict(model)))


def engine_on(folder, dtype=torch.float32) -> SGLangEngine:
    engine = SGLangEngine.__new__(SGLangEngine)
    engine.model_path, engine.dtype = str(folder), dtype
    engine._attach(WeightVerbs(), LoraLaunch(None))
    engine._served_digest(0, folder_digest(folder, engine._names(), dtype))
    engine._loop.loop.call_soon_threadsafe(engine._loop.loop.stop)
    return engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_digest_of_the_folder_is_the_torch_engines(folder, dtype):
    assert engine_on(folder, dtype).base_digest == torch_engine_digest(folder, dtype)


def test_the_digest_follows_each_base_push_and_is_unknown_after_nccl(folder, tmp_path):
    engine = engine_on(folder)
    start = engine.base_digest
    tensors = load_file(folder / "model.safetensors")
    tensors = {n: t + 0.01 if t.is_floating_point() else t for n, t in tensors.items()}
    engine.stage_weights(tensors, 1)
    assert engine.served_base() == (0, start)  # staged is not served
    engine.commit_weights(1)
    pushed = base_digest(*tensor_checksums({n: tensors[n] for n in engine._names()}))
    assert engine.served_base() == (1, pushed) and pushed != start
    save_file({n: t - 0.01 if t.is_floating_point() else t for n, t in tensors.items()}, tmp_path / "m.safetensors")
    engine.stage_weights_from_path(str(tmp_path), 2)
    engine.commit_weights(2)
    assert engine.served_base()[0] == 2 and engine.base_digest not in (start, pushed)
    assert engine.base_digest_of(1) == pushed and engine.base_digest_of(0) == start  # each token's policy
    engine.update_weights_from_distributed([], [], [], 3)
    assert engine.served_base() == (3, None)  # no bytes passed through the replica


def test_a_folder_missing_a_tensor_has_no_digest(folder, tmp_path):
    tensors = load_file(folder / "model.safetensors")
    save_file({n: t for n, t in list(tensors.items())[1:]}, tmp_path / "model.safetensors")
    assert folder_digest(tmp_path, engine_on(folder)._names(), torch.float32) is None
    assert folder_digest(tmp_path / "none", {"x"}, torch.float32) is None  # no safetensors at all
