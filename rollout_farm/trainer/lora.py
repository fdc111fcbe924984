"""The actor as a peft LoRA model (`actor_rollout_ref.model.lora_rank` > 0).

The base stays frozen and only the adapter's A and B matrices train. The reference policy is the same model called
with its adapter disabled (peft's `disable_adapter`, as verl does when the reference lives in the actor), so no
second copy of the base is kept. peft starts B at zero, so the first adapter pushed is the base itself.

What the farm needs of the model: the adapter's files as `save_pretrained` writes them, and the base's tensors under
the names the farm serves them, for the base digest (rollout_farm/trainer/sync/adapter.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollout_farm.services.weights.state_dict import canonical_state_dict
from rollout_farm.trainer.config import ModelConfig

PEFT_PREFIX = "base_model.model."  # peft's name for the wrapped model


def wrap(model: torch.nn.Module, cfg: ModelConfig) -> torch.nn.Module:
    """The model with a fresh LoRA adapter (r = lora_rank, lora_alpha, target_modules) on its frozen weights."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=cfg.target_modules, bias="none")
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # peft's "Target modules {...} not found in the base model"
        raise ValueError(f"actor_rollout_ref.model.target_modules: {e}") from None


class Reference:
    """The reference policy of LoRA training: the actor's peft model called with its adapter disabled, which is the
    frozen base. Called as a model is (forward.response_logits)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, **inputs):
        with self.model.disable_adapter():
            return self.model(**inputs)


def base_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base's tensors (no copy) under the names the farm serves them: save_pretrained's, as the model had
    before peft wrapped it (`base_model.model.` and the wrapped layers' `.base_layer` dropped, the adapter's
    tensors left out)."""
    out = {}
    for name, t in canonical_state_dict(model).items():
        if ".lora_" not in name:
            out[name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")] = t
    return out


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that train: the adapter's with LoRA, every one otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


def save_adapter(model: torch.nn.Module, folder: Path) -> Path:
    """The adapter alone as a peft folder: adapter_config.json and adapter_model.safetensors."""
    model.save_pretrained(folder)
    return folder
