"""LoRA adapters on SGLang (sglang_engine.py makes the calls; nothing here imports sglang): how the engine is launched
for them, what it can load safely, the peft folder it reads, and which adapter keys are staged, resident, in use and
retiring.

Launch (LoraLaunch): SGLang sizes its adapter buffers at start, from max_lora_rank, lora_target_modules (module leaf
names: q_proj, ..., down_proj) and max_loras_per_batch (distinct adapters in one running batch, the base model
counting as one). Without a max rank the engine starts without LoRA and refuses adapters (a 501).

What SGLang 0.5.14 checks at load is only the config's rank and target_modules against those buffers; a tensor it
cannot place is found when a batch first uses the adapter, in the scheduler, and takes the engine down
(tests/unit/test_sglang_contract.py pins each of these in the wheel's source). So an adapter is checked before it is
loaded (check_adapter), each misfit named (AdapterInvalid, a 422):
  - peft_format.check_fit against the model's linear layers (module paths and shapes, read from the model's config on
    the meta device); where they cannot be listed, the tensors' own shapes (rank only);
  - r <= max_lora_rank, and each module's leaf, normalised as SGLang normalises it (q/k/v -> qkv_proj,
    gate/up -> gate_up_proj), among the launch's target modules;
  - a module under `layers.<N>.` (SGLang drops, or cannot place, the others), embed_tokens/lm_head aside when
    they are targeted;
  - in each attention block, k_proj or v_proj only with q_proj, and q_proj only with v_proj (SGLang stacks q, k, v
    into qkv_proj from q's name, with a missing k as zeros); in each MLP, up_proj only with gate_proj.
rsLoRA: SGLang scales by lora_alpha / r, so the folder's lora_alpha is alpha * sqrt(r) (the same scaling).

The folder (sglang_config, write_folder): adapter_config.json with peft_type, r, lora_alpha and target_modules written
out (SGLang reads them without defaults) and adapter_model.safetensors, nothing else (SGLang would read an
added_tokens.json, and every *.safetensors file).

Keys (AdapterTable): a key (`name@vN`, never reused for other bytes) is SGLang's lora_name. staged: loaded, not yet
named by any call; resident: calls may name it (each pins it until SGLang has returned); retiring: no new call may
name it, unloaded when its last call ends. Unloading comes after routing stops because SGLang re-loads an unloaded
name from its remembered folder when a request names it; the folder is deleted after the unload, so such a request
fails instead.
"""

from __future__ import annotations

import json
import math
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout_farm.services.adapters.peft_format import (
    CONFIG_FILE,
    TENSORS_FILE,
    AdapterInvalid,
    LoraConfig,
    check_fit,
    module_pairs,
    problem,
)
from rollout_farm.services.weights.state_dict import spec_of

# what the farm launches SGLang with when FARM_SGLANG_LORA_TARGET_MODULES is not set: a Llama-style model's linears
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_LORAS_PER_BATCH = 8  # SGLang's own default (ServerArgs.max_loras_per_batch)
# SGLang's SUPPORTED_LORA_TARGET_MODULES (sglang/srt/utils/common.py), and "all"
SGLANG_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_b_proj",
    "kv_b_proj",
    "wq_b",
    "wk",
    "weights_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "embed_tokens",
    "lm_head",
)
ALL = "all"
# the leaf names SGLang's get_normalized_target_modules maps (sglang/srt/lora/utils.py); any other stays as it is
NORMALIZED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "embed_tokens": "embed_tokens",
    "lm_head": "lm_head",
}
OUTSIDE_LAYERS = ("embed_tokens", "lm_head")  # the modules SGLang adapts without a layer index, when targeted
LAYER = re.compile(r"layers\.(\d+)\.")  # SGLang's get_layer_id (sglang/srt/layers/utils/common.py)
KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]*")  # a farm key, name@vN; SGLang's model:adapter syntax forbids ':'


def normalized(leaf: str) -> str:
    return NORMALIZED.get(leaf, leaf)


@dataclass(frozen=True)
class LoraLaunch:
    """The LoRA part of the engine's launch; max_rank None: no LoRA (no buffers, adapters refused)."""

    max_rank: int | None = None
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH

    @property
    def enabled(self) -> bool:
        return self.max_rank is not None

    def problems(self) -> list[str]:
        """Why SGLang would refuse this launch (or serve no adapter): [] when it fits."""
        if not self.enabled:
            return []
        bad = []
        if self.max_rank < 1:
            bad.append(f"the LoRA max rank is {self.max_rank}: give a rank of 1 or more")
        if self.max_loras_per_batch < 1:
            bad.append(f"max_loras_per_batch is {self.max_loras_per_batch}: give 1 or more")
        unknown = [m for m in self.target_modules if m not in (*SGLANG_TARGET_MODULES, ALL)]
        if unknown:
            bad.append(f"SGLang cannot adapt {unknown}: the target modules are among {list(SGLANG_TARGET_MODULES)}")
        if not self.target_modules:
            bad.append("no LoRA target modules: name the modules adapters may adapt, e.g. q_proj and v_proj")
        if ALL in self.target_modules and len(self.target_modules) > 1:
            bad.append(
                f"{ALL!r} stands alone in the target modules, not with {sorted(set(self.target_modules) - {ALL})}"
            )
        return bad

    def targets(self) -> set[str]:
        """The target modules as SGLang normalises them ({"all"} for all)."""
        return {ALL} if ALL in self.target_modules else {normalized(m) for m in self.target_modules}


def check_adapter(
    config: LoraConfig,
    tensors: dict[str, torch.Tensor],
    linears: dict[str, tuple[int, int]] | None,
    launch: LoraLaunch,
    served_name: str | None = None,
) -> dict[str, tuple[str, str]]:
    """The adapter's module pairs (module path -> (lora_A name, lora_B name)) when SGLang, launched with `launch`, can
    serve it; AdapterInvalid naming every misfit. `linears`: the served model's linear layers (module path ->
    (in_features, out_features)); None when the engine cannot list them (then the tensors' own shapes stand in, and
    only their rank is checked)."""
    specs = spec_of(tensors)
    if linears is None:  # each module as wide as its own tensors say
        two_d = {m: (a, b) for m, (a, b) in module_pairs(specs).items() if len(specs[a][0]) == len(specs[b][0]) == 2}
        linears = {m: (specs[a][0][1], specs[b][0][0]) for m, (a, b) in two_d.items()}
    pairs = check_fit(config, specs, linears, served_name)
    bad = sglang_problems(config, list(pairs), launch)
    if bad:
        raise AdapterInvalid(bad[:10])
    return pairs


def sglang_problems(config: LoraConfig, modules: list[str], launch: LoraLaunch) -> list[dict]:
    """What SGLang cannot serve of an adapter that fits the model: its rank, and the modules it adapts."""
    bad = []
    if config.r > launch.max_rank:
        bad.append(
            problem(
                "adapter_config.r",
                f"rank {config.r} is above the engine's max LoRA rank {launch.max_rank} (FARM_SGLANG_MAX_LORA_RANK): "
                "train a smaller rank, or start the engines with a larger max rank",
            )
        )
    targets = launch.targets()
    leaves = {m.rsplit(".", 1)[-1] for m in modules}
    untargeted = sorted(leaf for leaf in leaves if normalized(leaf) not in targets) if ALL not in targets else []
    if untargeted:
        bad.append(
            problem(
                "adapter_config.target_modules",
                f"{untargeted} are not among the engine's LoRA target modules {list(launch.target_modules)} "
                "(FARM_SGLANG_LORA_TARGET_MODULES): train without them, or start the engines with them",
            )
        )
    outside = [m for m in modules if not LAYER.search(f"{m}.") and m.rsplit(".", 1)[-1] not in OUTSIDE_LAYERS]
    bad += [
        problem("adapter_model", f"module {m!r} is in no decoder layer (layers.<N>.): SGLang cannot adapt it")
        for m in outside[:3]
    ]
    blocks: dict[str, set[str]] = {}
    for m in modules:
        parent, _, leaf = m.rpartition(".")
        blocks.setdefault(parent, set()).add(leaf)
    for parent, leaves in sorted(blocks.items()):
        qkv = leaves & {"q_proj", "k_proj", "v_proj"}
        if qkv and not {"q_proj", "v_proj"} <= qkv:
            bad.append(
                problem(
                    "adapter_config.target_modules",
                    f"{parent} adapts {sorted(qkv)}: SGLang serves k_proj and v_proj only together with q_proj, and "
                    "q_proj only with v_proj (it stacks them into one qkv_proj); train with q_proj and v_proj",
                )
            )
        if "up_proj" in leaves and "gate_proj" not in leaves:
            bad.append(
                problem(
                    "adapter_config.target_modules",
                    f"{parent} adapts up_proj without gate_proj: SGLang serves up_proj only together with gate_proj "
                    "(it stacks them into one gate_up_proj); train with gate_proj too",
                )
            )
    return bad


def sglang_config(config: LoraConfig, pairs: dict[str, tuple[str, str]], base: str | None = None) -> dict:
    """adapter_config.json for SGLang: every key it reads written out; rsLoRA folded into lora_alpha (SGLang scales by
    lora_alpha / r, which then equals alpha / sqrt(r))."""
    alpha = config.lora_alpha * math.sqrt(config.r) if config.use_rslora else config.lora_alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.r,
        "lora_alpha": alpha,
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in pairs}),
        "base_model_name_or_path": config.base_model_name_or_path or base,
    }


def write_folder(folder: Path, config_dict: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A peft adapter folder holding only adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(folder / TENSORS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2))
    return folder


@dataclass
class Held:
    """A key loaded in SGLang: its folder and its tensors' bytes."""

    folder: Path
    bytes: int


class AdapterTable:
    """The keys loaded in SGLang, by state (staged, resident, retiring), the calls pinning each, and the unloads under
    way. Thread-safe. The verbs that end a key's use (discard, retire, unpin) return its Held when it is to be unloaded
    now, else None."""

    def __init__(self):
        self._lock = threading.Lock()
        self.staged: dict[str, Held] = {}
        self.resident: dict[str, Held] = {}
        self.retiring: dict[str, Held] = {}
        self.pins: dict[str, int] = {}
        self.unloading: dict[str, Future] = {}

    def holds(self, key: str) -> bool:
        """Loaded and staged or resident."""
        with self._lock:
            return key in self.staged or key in self.resident

    def stage(self, key: str, held: Held) -> None:
        with self._lock:
            self.staged[key] = held

    def reclaim(self, key: str) -> bool:
        """A retiring key staged again: it is loaded still, so it is staged without a load. False when not retiring."""
        with self._lock:
            held = self.retiring.pop(key, None)
            if held is not None:
                self.staged[key] = held
            return held is not None

    def commit(self, key: str) -> None:
        """Staged -> resident (a no-op when resident); KeyError when it is neither."""
        with self._lock:
            if key not in self.resident:
                self.resident[key] = self.staged.pop(key)

    def discard(self, key: str) -> Held | None:
        with self._lock:
            return self.staged.pop(key, None)

    def retire(self, key: str) -> Held | None:
        """No new call may use `key`: its Held to unload now, or None (not loaded, or calls use it: retiring)."""
        with self._lock:
            held = self.resident.pop(key, None) or self.staged.pop(key, None)
            if held is not None and self.pins.get(key):
                self.retiring[key] = held
                return None
            return held

    def pin(self, key: str) -> None:
        """A call uses `key` until unpin; KeyError when it is not resident."""
        with self._lock:
            if key not in self.resident:
                raise KeyError(key)
            self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key: str) -> Held | None:
        """The Held of a retiring key whose last call this was (to unload now), else None."""
        with self._lock:
            self.pins[key] -= 1
            if self.pins[key]:
                return None
            del self.pins[key]
            return self.retiring.pop(key, None)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """key -> (bytes, calls using it) of the resident keys."""
        with self._lock:
            return {k: (h.bytes, self.pins.get(k, 0)) for k, h in self.resident.items()}

    def unload_started(self, key: str, future: Future) -> None:
        with self._lock:
            self.unloading[key] = future
        future.add_done_callback(lambda f: self._unload_ended(key, f))

    def _unload_ended(self, key: str, future: Future) -> None:
        with self._lock:
            if self.unloading.get(key) is future:
                del self.unloading[key]

    def pending_unload(self, key: str) -> Future | None:
        with self._lock:
            return self.unloading.get(key)
