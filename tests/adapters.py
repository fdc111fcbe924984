"""peft LoRA adapters for the tests: made with peft itself on a model folder, their B matrices drawn at random (peft
initialises B to zero, which would make every adapter the base model); pushing them and sampling from them over HTTP."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rollout_farm.services.client.peft_files import upload_body
from tests.conftest import TOKEN


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


ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = [{"text": "1 + 2 ="}, {"text": "7 * 3 ="}]


def push(http, name: str, version: int, folder: Path, headers: dict = ADMIN, probe: dict | None = None):
    """POST /v1/adapters/{name}: the folder uploaded as peft_files.upload_body makes it."""
    body = upload_body(folder, probe)
    return http.post(f"/v1/adapters/{name}", params={"version": version}, content=body, headers=headers)


def rollout(http, adapter=None, headers=None, prompts=PROMPTS, n=2, **params):
    """A greedy rollout; a 429 (the test service's small queues) is retried after its Retry-After."""
    body = {"prompts": prompts, "n": n, "sampling_params": {"temperature": 0, "max_new_tokens": 6, **params}}
    if adapter is not None:
        body["adapter"] = adapter
    for _ in range(100):
        answer = http.post("/v1/rollouts", json=body, headers=headers or {})
        if answer.status_code != 429 or "tenant" in answer.text:  # a tenant's refusal is the answer itself
            return answer
        time.sleep(float(answer.headers.get("retry-after", 1)))
    return answer
