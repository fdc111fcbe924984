"""peft LoRA adapters for the tests: made with peft itself on a model folder, their B matrices drawn at random (peft
initialises B to zero, which would make every adapter the base model)."""

from __future__ import annotations

from pathlib import Path

import torch


def peft_adapter(
    base: Path,
    out: Path,
    seed: int,
    r: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"),
    scale: float = 0.3,
) -> Path:
    """A peft adapter folder (adapter_config.json, adapter_model.safetensors) for the model at `base`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(out)
    return out


def adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(folder) / "adapter_model.safetensors")
