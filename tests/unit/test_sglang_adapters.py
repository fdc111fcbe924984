"""The SGLang engine's adapter verbs, against a stand-in for sglang.Engine that behaves as the pinned wheel does
(tests/unit/test_sglang_contract.py pins each behaviour in its source): a load refuses a name it holds and reads the
folder's adapter_config.json without defaults; an unload of an unknown name is `success=False, "... does not
exist"`; a request naming a name it does not hold raises ValueError. SGLang itself needs a GPU: the GPU test
(tests/gpu/test_sglang_adapters.py) compares its outputs with a merged model."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout_farm.services.adapters.peft_format import AdapterInvalid, LoraConfig
from rollout_farm.services.engine.base import AdapterNotResident
from rollout_farm.services.engine.sglang_adapters import LoraLaunch, check_adapter
from rollout_farm.services.engine.sglang_engine import SGLangEngine
from rollout_farm.services.errors import EngineVerbMissing
from rollout_farm.services.protocol import SamplingParams
from rollout_farm.services.weights.checks import WeightsRejected

HIDDEN, FFN, LAYERS = 64, 256, 2
GREEDY = SamplingParams(temperature=0, max_new_tokens=1)


@dataclass
class Result:  # LoRAUpdateOutput's fields that the adapter reads
    success: bool
    error_message: str | None = ""


class FakeSGLang:
    """sglang.Engine's LoRA verbs and async_generate, as the pinned wheel behaves; `hold` keeps requests in flight."""

    def __init__(self):
        self.loaded: dict[str, dict] = {}  # lora_name -> {"path", "config", "files"}
        self.loads, self.unloads, self.sent = [], [], []
        self.hold = threading.Event()
        self.hold.set()
        self.tokenizer_manager = SimpleNamespace(abort_request=lambda *a, **k: None)

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> Result:
        self.loads.append(lora_name)
        if lora_name in self.loaded:
            return Result(False, f"Failed to load LoRA adapter {lora_name} because it is already loaded")
        folder = Path(lora_path)
        config = json.loads((folder / "adapter_config.json").read_text())
        try:  # read as SGLang reads them: no defaults
            assert config["peft_type"].lower() == "lora"
            _ = config["target_modules"], config["r"], config["lora_alpha"]
        except KeyError as e:
            return Result(False, f"missing {e}")
        if config["r"] > 8:  # the memory pool's rank check
            return Result(False, f"LoRA adapter {lora_name} with rank {config['r']} is incompatible")
        self.loaded[lora_name] = {"path": folder, "config": config, "files": sorted(p.name for p in folder.iterdir())}
        return Result(True, "")

    async def async_unload_lora_adapter(self, lora_name: str) -> Result:
        self.unloads.append(lora_name)
        if self.loaded.pop(lora_name, None) is None:
            return Result(False, f"LoRA with name {lora_name} does not exist. Loaded LoRAs: {list(self.loaded)}")
        return Result(True, "")

    async def async_generate(self, input_ids, sampling_params, rid, return_logprob=False, lora_path=None):
        if lora_path is not None and lora_path not in self.loaded:
            raise ValueError(f"Got LoRA adapter that has never been loaded: {lora_path}\nAll loaded adapters: ...")
        self.sent.append((len(input_ids), sampling_params["max_new_tokens"], lora_path))
        while not self.hold.is_set():
            await asyncio.sleep(0.01)
        meta = {"prompt_tokens": 3, "cached_tokens": 0, "finish_reason": {"type": "length"}}
        return [{"output_ids": [7], "meta_info": {**meta, "output_token_logprobs": [(-0.5, 7, None)]}} for _ in rid]


@pytest.fixture
def model_folder(tmp_path) -> Path:
    """A Llama's config alone: the engine reads its linear layers from it on the meta device."""
    from transformers import LlamaConfig

    folder = tmp_path / "tiny-llama"
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    config.save_pretrained(folder)
    return folder


def make_engine(model_folder: Path, lora: LoraLaunch | None = None) -> SGLangEngine:
    engine = SGLangEngine.__new__(SGLangEngine)
    engine.model_path, engine.dtype = str(model_folder), torch.float32
    engine._attach(FakeSGLang(), LoraLaunch(8) if lora is None else lora)
    return engine


@pytest.fixture
def engine(model_folder):
    e = make_engine(model_folder)
    yield e
    e._loop.loop.call_soon_threadsafe(e._loop.loop.stop)


def tensors(modules=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"), r=4, seed=0, layers=range(LAYERS)):
    """peft-named tensors for the tiny Llama: module leaf -> (in, out) from its config."""
    shapes = {
        "q_proj": (HIDDEN, HIDDEN),
        "k_proj": (HIDDEN, HIDDEN),
        "v_proj": (HIDDEN, HIDDEN),
        "o_proj": (HIDDEN, HIDDEN),
        "gate_proj": (HIDDEN, FFN),
        "up_proj": (HIDDEN, FFN),
        "down_proj": (FFN, HIDDEN),
    }
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        for module in modules:
            n_in, n_out = shapes[module.rsplit(".", 1)[-1]]
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(r, n_in, generator=gen)
            out[f"{prefix}.lora_B.weight"] = torch.randn(n_out, r, generator=gen)
    return out


def unloads_settled(engine: SGLangEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while engine._adapters.unloading and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine._adapters.unloading


def test_a_pushed_adapter_is_loaded_as_a_peft_folder_and_named_by_every_request(engine):
    engine.stage_adapter("a@v1", LoraConfig(4, 8.0), tensors())
    llm = engine.llm
    assert llm.loads == ["a@v1"]
    loaded = llm.loaded["a@v1"]
    assert loaded["files"] == ["adapter_config.json", "adapter_model.safetensors"]  # nothing else SGLang would read
    config = loaded["config"]
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"]) == ("LORA", 4, 8.0, False)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    from safetensors.torch import load_file

    assert load_file(loaded["path"] / "adapter_model.safetensors").keys() == tensors().keys()
    # staged: loaded, but no call may name it before the commit
    with pytest.raises(AdapterNotResident):
        engine.generate([[1, 2, 3]], GREEDY, adapter="a@v1")
    assert engine.resident_adapters() == {}
    engine.commit_adapter("a@v1")
    engine.commit_adapter("a@v1")  # a no-op once resident
    nbytes = sum(t.numel() * 4 for t in tensors().values())
    assert engine.resident_adapters() == {"a@v1": (nbytes, 0)}
    # a group: the prefix prefill and the samples both name the adapter; the base model's requests name none
    outs = engine.generate([[1, 2, 3]] * 3, GREEDY, adapter="a@v1")
    assert [o.token_ids for o in outs] == [[7]] * 3
    engine.generate([[1, 2, 3]], GREEDY)
    assert llm.sent == [(1, 0, "a@v1"), (3, 1, "a@v1"), (1, 1, None)]
    with pytest.raises(AdapterNotResident):
        engine.generate([[1, 2, 3]], GREEDY, adapter="b@v1")  # never staged: refused before SGLang sees it
    assert len(llm.sent) == 3


def test_rslora_is_served_with_the_same_scaling():
    """SGLang scales by lora_alpha / r: the staged config's alpha makes that alpha / sqrt(r)."""
    from rollout_farm.services.engine.sglang_adapters import sglang_config

    config = LoraConfig(16, 8.0, use_rslora=True)
    written = sglang_config(config, {"model.layers.0.self_attn.q_proj": ("a", "b")})
    assert written["use_rslora"] is False
    assert math.isclose(written["lora_alpha"] / written["r"], config.scaling)


def problems_of(exc: AdapterInvalid) -> list[tuple[str, str]]:
    return [(p["field"], p["message"]) for p in exc.problems]


@pytest.mark.parametrize(
    "modules, r, launch, field, words",
    [
        (("self_attn.q_proj", "self_attn.v_proj"), 16, LoraLaunch(8), "adapter_config.r", "above the engine's max"),
        (("self_attn.k_proj", "self_attn.v_proj"), 4, LoraLaunch(8), "adapter_config.target_modules", "with q_proj"),
        (("self_attn.q_proj",), 4, LoraLaunch(8), "adapter_config.target_modules", "only with v_proj"),
        (("mlp.up_proj",), 4, LoraLaunch(8), "adapter_config.target_modules", "up_proj without gate_proj"),
        (
            ("self_attn.o_proj", "mlp.down_proj"),
            4,
            LoraLaunch(8, ("q_proj", "v_proj", "o_proj")),
            "adapter_config.target_modules",
            "['down_proj'] are not among",
        ),
    ],
)
def test_an_adapter_sglang_cannot_serve_is_refused_before_it_loads(engine, modules, r, launch, field, words):
    engine._lora = launch
    with pytest.raises(AdapterInvalid) as e:
        engine.stage_adapter("a@v1", LoraConfig(r, 8.0), tensors(modules, r=r))
    assert any(f == field and words in m for f, m in problems_of(e.value)), problems_of(e.value)
    assert engine.llm.loads == [] and engine._adapter_root is None  # refused before any folder or load


def test_the_rules_admit_what_sglang_stacks():
    """q and v without k (k becomes zeros), gate without up (up becomes zeros), every module of a Llama layer."""
    launch = LoraLaunch(8)
    for modules in (
        ("self_attn.q_proj", "self_attn.v_proj"),
        ("mlp.gate_proj",),
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
        ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    ):
        check_adapter(LoraConfig(4, 8.0), tensors(modules), None, launch)


def test_misfits_are_checked_against_the_models_linear_layers(engine):
    """The shapes come from the model's config (the meta device); an adapter for a wider model is refused."""
    wide = {k: torch.zeros(v.shape[0], v.shape[1] + 1) if "lora_A" in k else v for k, v in tensors().items()}
    with pytest.raises(AdapterInvalid) as e:
        engine.stage_adapter("a@v1", LoraConfig(4, 8.0), wide)
    assert any(f == "adapter_model" and "shape" in m for f, m in problems_of(e.value))
    assert engine._linears()["model.layers.0.mlp.down_proj"] == (FFN, HIDDEN)
    head = {
        "base_model.model.lm_head.lora_A.weight": torch.zeros(4, HIDDEN),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(300, 4),
    }
    with pytest.raises(AdapterInvalid) as e:  # lm_head is a linear layer of the model, but not a target module
        engine.stage_adapter("a@v1", LoraConfig(4, 8.0), head)
    assert any("['lm_head'] are not among" in m for _, m in problems_of(e.value))
    nan = tensors()
    next(iter(nan.values()))[0, 0] = float("nan")
    with pytest.raises(WeightsRejected):
        engine.stage_adapter("a@v1", LoraConfig(4, 8.0), nan)
    assert engine.llm.loads == []


def test_without_the_linear_layers_the_tensors_own_shapes_and_the_rank_are_checked(engine):
    engine._linear_shapes = None  # the model could not be built on the meta device
    engine.stage_adapter("a@v1", LoraConfig(4, 8.0), tensors())
    bad = tensors()
    bad["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = torch.zeros(HIDDEN, 3)
    with pytest.raises(AdapterInvalid) as e:
        engine.stage_adapter("a@v2", LoraConfig(4, 8.0), bad)
    assert any("needs [64, 4]" in m for _, m in problems_of(e.value)), problems_of(e.value)


def test_sglangs_refusal_is_a_422_and_leaves_no_folder(engine):
    engine._lora = LoraLaunch(32)  # the farm admits rank 16; the stand-in's pool (8) refuses it
    with pytest.raises(AdapterInvalid) as e:
        engine.stage_adapter("a@v1", LoraConfig(16, 8.0), tensors(r=16))
    assert "SGLang did not load it" in str(e.value) and "incompatible" in str(e.value)
    assert list(engine._adapter_root.iterdir()) == []
    assert engine.resident_adapters() == {}


def test_retiring_an_adapter_in_use_unloads_it_when_its_last_call_ends(engine):
    llm = engine.llm
    engine.stage_adapter("a@v1", LoraConfig(4, 8.0), tensors())
    engine.commit_adapter("a@v1")
    folder = llm.loaded["a@v1"]["path"]
    llm.hold.clear()
    running = threading.Thread(target=engine.generate, args=([[1, 2, 3]], GREEDY), kwargs={"adapter": "a@v1"})
    running.start()
    deadline = time.monotonic() + 5
    while engine._adapters.pins.get("a@v1") != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine._adapters.pins == {"a@v1": 1}
    engine.retire_adapter("a@v1")  # does not wait
    assert engine.resident_adapters() == {}  # no new call may name it
    with pytest.raises(AdapterNotResident):
        engine.generate([[1, 2, 3]], GREEDY, adapter="a@v1")
    time.sleep(0.05)
    assert llm.unloads == [] and folder.is_dir()  # the running call still has it
    llm.hold.set()
    running.join(5)
    unloads_settled(engine)
    assert llm.unloads == ["a@v1"] and "a@v1" not in llm.loaded
    assert not folder.exists()  # deleted after the unload


def test_an_unused_adapter_is_unloaded_at_once_and_a_discard_unloads_a_staged_one(engine):
    llm = engine.llm
    engine.stage_adapter("a@v1", LoraConfig(4, 8.0), tensors())
    engine.commit_adapter("a@v1")
    engine.retire_adapter("a@v1")
    engine.stage_adapter("b@v1", LoraConfig(4, 8.0), tensors(seed=1))
    engine.discard_adapter("b@v1")
    unloads_settled(engine)
    assert sorted(llm.unloads) == ["a@v1", "b@v1"] and llm.loaded == {}
    assert list(engine._adapter_root.iterdir()) == []
    engine.retire_adapter("never@v1")  # nothing held: nothing to do
    engine.discard_adapter("never@v1")
    unloads_settled(engine)
    assert sorted(llm.unloads) == ["a@v1", "b@v1"]
    with pytest.raises(KeyError):
        engine.commit_adapter("b@v1")  # discarded: not staged any more


def test_a_key_staged_again_is_taken_back_or_loaded_after_its_unload(engine):
    """A replica's ensure_adapter may stage a key again after a discard (a digest mismatch) or while it retires."""
    llm = engine.llm
    engine.stage_adapter("a@v1", LoraConfig(4, 8.0), tensors())
    engine.stage_adapter("a@v1", LoraConfig(4, 8.0), tensors())  # held already: no second load
    assert llm.loads == ["a@v1"]
    engine.commit_adapter("a@v1")
    engine._adapters.pin("a@v1")  # a call in flight
    engine.retire_adapter("a@v1")
    engine.stage_adapter("a@v1", LoraConfig(4, 8.0), tensors())  # retiring, still loaded: taken back, no load
    engine.commit_adapter("a@v1")
    assert llm.loads == ["a@v1"] and "a@v1" in engine.resident_adapters()
    assert engine._adapters.unpin("a@v1") is None  # the call ends: the key is resident again, nothing to unload
    assert llm.unloads == []
    engine.retire_adapter("a@v1")
    engine.stage_adapter("a@v1", LoraConfig(4, 8.0), tensors())  # waits for the unload, then loads it again
    assert llm.unloads == ["a@v1"] and llm.loads == ["a@v1", "a@v1"] and "a@v1" in llm.loaded


def test_sglangs_own_unknown_adapter_error_is_adapter_not_resident(engine):
    """The backstop: a key the farm holds but SGLang does not (it never should) is AdapterNotResident too."""
    engine.stage_adapter("a@v1", LoraConfig(4, 8.0), tensors())
    engine.commit_adapter("a@v1")
    del engine.llm.loaded["a@v1"]
    with pytest.raises(AdapterNotResident):
        engine.generate([[1, 2, 3]], GREEDY, adapter="a@v1")
    assert engine._adapters.pins == {} and engine._inflight == 0


def test_an_engine_started_without_lora_refuses_adapters_naming_the_setting(model_folder):
    engine = make_engine(model_folder, LoraLaunch())
    with pytest.raises(EngineVerbMissing, match="FARM_SGLANG_MAX_LORA_RANK"):
        engine.stage_adapter("a@v1", LoraConfig(4, 8.0), tensors())
    assert engine.serves_adapters and engine.resident_adapters() == {}
    with pytest.raises(EngineVerbMissing):
        engine.score([[1, 2]], 0, adapter="a@v1")  # SGLang's engine scores nothing, with an adapter or without


@pytest.mark.parametrize(
    "launch, words",
    [
        (LoraLaunch(0), "max rank is 0"),
        (LoraLaunch(8, ("q_proj", "qproj")), "cannot adapt ['qproj']"),
        (LoraLaunch(8, ("all", "q_proj")), "stands alone"),
        (LoraLaunch(8, ()), "no LoRA target modules"),
        (LoraLaunch(8, max_loras_per_batch=0), "max_loras_per_batch is 0"),
    ],
)
def test_a_launch_sglang_would_refuse_is_refused_at_start(launch, words):
    assert any(words in p for p in launch.problems()), launch.problems()
    with pytest.raises(ValueError, match="max rank|cannot adapt|stands alone|no LoRA|max_loras"):
        SGLangEngine("m", max_lora_rank=launch.max_rank, lora_target_modules=launch.target_modules,
                     max_loras_per_batch=launch.max_loras_per_batch)  # fmt: skip
    assert LoraLaunch().problems() == []  # no LoRA: nothing to check


def test_the_lora_settings_reach_the_engine():
    """from_settings reads the LoRA settings with getattr: a settings object without them starts SGLang without LoRA
    (and passes no LoRA keyword); with them, they reach the engine; ServiceSettings's own reach it as they are."""
    from rollout_farm.services.config.settings import ServiceSettings
    from tests.conftest import TOKEN

    built = {}

    class Recorded(SGLangEngine):  # SGLang needs a GPU: the engine's constructor is replaced, its factory is real
        def __init__(self, model_path, device, dtype, threads, **kw):
            built.clear()
            built.update(kw)

    settings = SimpleNamespace(sglang_parallelism=(None, 1), device="cuda", dtype="bfloat16")
    Recorded.from_settings("m", settings, None)
    assert built == {"mem_fraction_static": None, "tp_size": 1}
    settings.sglang_max_lora_rank = 32
    Recorded.from_settings("m", settings, None)  # the other two default to SGLang's and the farm's defaults
    assert built["max_lora_rank"] == 32 and built["max_loras_per_batch"] == 8
    assert built["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    settings.sglang_lora_target_modules, settings.sglang_max_loras_per_batch = ["q_proj", "v_proj"], 4
    Recorded.from_settings("m", settings, None)
    assert built == {
        "mem_fraction_static": None,
        "tp_size": 1,
        "max_lora_rank": 32,
        "lora_target_modules": ["q_proj", "v_proj"],
        "max_loras_per_batch": 4,
    }
    real = ServiceSettings(api_token=TOKEN, engine="sglang", device="cuda")
    Recorded.from_settings("m", real, None)
    rank = getattr(real, "sglang_max_lora_rank", None)
    assert built.get("max_lora_rank") == rank
    if rank is not None:
        assert built["lora_target_modules"] == list(real.sglang_lora_target_modules)
        assert built["max_loras_per_batch"] == real.sglang_max_loras_per_batch
