"""peft's LoRA adapter format, read and checked against the base model before any replica loads a byte of it.

A peft adapter folder is `adapter_config.json` and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module path>.lora_A.weight` (rank x in_features) and `...lora_B.weight` (out_features x rank). Each
adapted module's output gains `scaling * B @ A @ x`, scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).

What the farm serves: plain LoRA on linear layers (peft_type "LORA"), one rank and alpha for every module. Refused,
each naming the field: DoRA (`use_dora`), per-module ranks (`rank_pattern`, `alpha_pattern`), trained copies of
whole modules (`modules_to_save`: push those as base weights), biases (`bias` other than "none"), Conv1D layouts
(`fan_in_fan_out`), and an adapter made for another base model (`base_model_name_or_path`, and any module or shape
that is not the served model's). `lora_dropout` only acts in training and is accepted.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass

from rollout_farm.services.client.peft_files import (  # the folder's files; re-exported for the engines
    CONFIG_FILE,
    CONFIG_META,
    TENSORS_FILE,
    AdapterInvalid,
    folder_files,
    problem,
)

__all__ = ["CONFIG_FILE", "CONFIG_META", "TENSORS_FILE", "AdapterInvalid", "LoraConfig", "problem"]

PREFIX = "base_model.model."
KINDS = ("lora_A", "lora_B")
MAX_RANK = 1024
# fields that change what the adapter computes and that the farm does not serve: field -> (what is accepted, why)
REFUSED = {
    "use_dora": (False, "DoRA is not served: train a plain LoRA adapter"),
    "rank_pattern": ({}, "per-module ranks are not served: use one r for every module"),
    "alpha_pattern": ({}, "per-module alphas are not served: use one lora_alpha for every module"),
    "modules_to_save": (None, "trained copies of whole modules are not served: push them as base weights"),
    "bias": ("none", 'trained biases are not served: train with bias="none"'),
    "fan_in_fan_out": (False, "Conv1D layouts (GPT-2) are not served"),
    "layers_to_transform": (None, "layer subsets are not served: name the modules in target_modules"),
}


@dataclass(frozen=True)
class LoraConfig:
    """What an adapter computes besides its tensors: rank, alpha, rsLoRA, and the base model it was made for."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    base_model_name_or_path: str | None = None

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def canonical(self) -> str:
        """The fields that change the outputs, as compact JSON (part of the policy digest)."""
        return json.dumps({"r": self.r, "lora_alpha": float(self.lora_alpha), "use_rslora": self.use_rslora})

    def to_json(self) -> str:
        return json.dumps({"peft_type": "LORA", **self.__dict__})


def read_config(raw: bytes | str | dict) -> LoraConfig:
    """adapter_config.json's content, checked; AdapterInvalid naming each wrong field (as `adapter_config.<field>`)."""
    if not isinstance(raw, dict):
        try:
            raw = json.loads(raw)
        except (ValueError, TypeError) as e:
            raise AdapterInvalid([problem("adapter_config", f"is not JSON ({e}): send peft's adapter_config.json")])
        if not isinstance(raw, dict):
            raise AdapterInvalid([problem("adapter_config", "is not a JSON object: send peft's adapter_config.json")])
    bad = []
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        bad.append(problem("adapter_config.peft_type", f"{raw.get('peft_type')!r} is not served: only LORA"))
    r, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_RANK:
        bad.append(problem("adapter_config.r", f"{r!r} is not a rank: an integer in 1..{MAX_RANK}"))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        bad.append(problem("adapter_config.lora_alpha", f"{alpha!r} is not a positive number"))
    for field, (accepted, why) in REFUSED.items():
        if raw.get(field) not in (accepted, None, False, {}, []):
            bad.append(problem(f"adapter_config.{field}", f"{raw[field]!r}: {why}"))
    base = raw.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        bad.append(problem("adapter_config.base_model_name_or_path", "is not a string"))
    if bad:
        raise AdapterInvalid(bad)
    return LoraConfig(r, float(alpha), bool(raw.get("use_rslora", False)), base)


def module_pairs(names: dict[str, tuple[list[int], str]]) -> dict[str, tuple[str, str]]:
    """module path -> (its lora_A tensor name, its lora_B tensor name), from the tensors' names and specs; every
    tensor must be one of such a pair."""
    found: dict[str, dict[str, str]] = {}
    stray = []
    for name in names:
        parts = name.removeprefix(PREFIX).split(".")
        if not name.startswith(PREFIX) or len(parts) < 3 or parts[-2] not in KINDS or parts[-1] != "weight":
            stray.append(name)
            continue
        found.setdefault(".".join(parts[:-2]), {})[parts[-2]] = name
    bad = [
        problem("adapter_model", f"tensor {n!r} is not a peft LoRA tensor ({PREFIX}<module>.lora_A|lora_B.weight)")
        for n in stray[:5]
    ]
    bad += [
        problem("adapter_model", f"module {m!r} has {sorted(k)} but needs both lora_A and lora_B")
        for m, k in found.items()
        if set(k) != set(KINDS)
    ][:5]
    if not found and not stray:
        bad.append(problem("adapter_model", "holds no tensor: an adapter adapts at least one module"))
    if bad:
        raise AdapterInvalid(bad)
    return {m: (k["lora_A"], k["lora_B"]) for m, k in sorted(found.items())}


def check_fit(
    config: LoraConfig,
    specs: dict[str, tuple[list[int], str]],
    linears: dict[str, tuple[int, int]],
    served_name: str | None = None,
) -> dict[str, tuple[str, str]]:
    """The adapter (its config and tensor specs: name -> (shape, dtype)) against the served model's linear layers
    (module path -> (in_features, out_features)): module_pairs, or AdapterInvalid naming every misfit."""
    pairs = module_pairs(specs)
    bad = []
    base = config.base_model_name_or_path
    if base and served_name and _stem(base) != _stem(served_name):
        bad.append(
            problem(
                "adapter_config.base_model_name_or_path",
                f"the adapter was made for {base!r}, but this farm serves {served_name!r}: train it on that model",
            )
        )
    for module, (a, b) in pairs.items():
        if module not in linears:
            near = [m for m in linears if m.split(".")[-1] == module.split(".")[-1]][:1]
            hint = f" (the served model has e.g. {near[0]!r})" if near else " (not a linear layer of the served model)"
            bad.append(problem("adapter_model", f"module {module!r} is not in the served model{hint}"))
            continue
        n_in, n_out = linears[module]
        for name, want in ((a, [config.r, n_in]), (b, [n_out, config.r])):
            shape, dtype = specs[name]
            if list(shape) != want:
                bad.append(
                    problem(
                        "adapter_model",
                        f"{name} has shape {list(shape)}, the served model needs {want} "
                        f"(r={config.r} from adapter_config)",
                    )
                )
            if dtype not in ("F32", "F16", "BF16"):
                bad.append(problem("adapter_model", f"{name} has dtype {dtype}: LoRA tensors are F32, F16 or BF16"))
    if bad:
        raise AdapterInvalid(bad[:10])
    return pairs


def _stem(name: str) -> str:
    return pathlib.PurePath(name.rstrip("/")).name.lower()


def read_folder(path: str | pathlib.Path) -> tuple[LoraConfig, pathlib.Path]:
    """A peft adapter folder: its config, checked, and the path of its tensors file."""
    config_file, tensors_file = folder_files(path)
    return read_config(config_file.read_bytes()), tensors_file
