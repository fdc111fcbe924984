"""FARM_ENGINE=auto: the engine that serves a model fastest where it runs, by the figures of bench/engines.py
(docs/data/engines.json; docs/architecture.md "Engines"):
- on CUDA, SGLang (the production engine);
- on CPU, vLLM's CPU build for a real model (at least AUTO_VLLM_MIN_PARAMETERS: on SmolLM2-135M it samples faster
  than the farm's torch engine) when its environment is installed (.venv-vllm or FARM_VLLM_PYTHON), else torch;
  torch for a toy model (arith-tiny, 1.1M parameters: vLLM's per-step overhead costs more than the model)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_farm.services.config.settings import ServiceSettings

log = logging.getLogger("farm.service")
AUTO_VLLM_MIN_PARAMETERS = 50_000_000


def parameter_count(model_path: str) -> int:
    """The model's parameters, from its config (built on the meta device: nothing is allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters())


def engine_name(settings: ServiceSettings) -> str:
    """FARM_ENGINE, with "auto" resolved (see the module docstring)."""
    if settings.engine != "auto":
        return settings.engine
    if settings.device.startswith("cuda"):
        return "sglang"
    from rollout_farm.services.engine.vllm_server import vllm_python
    from rollout_farm.services.models import resolve_model

    try:
        vllm_python(settings.vllm_python or None)
    except RuntimeError:
        return "torch"
    parameters = parameter_count(str(resolve_model(settings.model)))
    chosen = "vllm" if parameters >= AUTO_VLLM_MIN_PARAMETERS else "torch"
    log.info("engine_auto", extra={"engine": chosen, "parameters": parameters})
    return chosen
