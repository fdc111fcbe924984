"""Engines: the lifecycle interface (base.py) and one registry of implementations.

| module | owns |
| --- | --- |
| `base.py` | Engine, the lifecycle verbs every engine implements; EngineOutput; the ENGINES registry |
| `torch/` | the torch engine (FARM_ENGINE=torch, the default; what CI and development use): any HF causal LM |
| `sglang_engine.py` | SGLang's offline engine on GPUs (the optional `sglang` extra, imported when the engine starts) |
| `sglang_adapters.py` | LoRA on SGLang: its launch, the checks before a load, the peft folder, the keys' states |
| `sglang_adapter_verbs.py` | SGLang's adapter verbs: stage, commit, discard and retire under SGLang's LoRA calls |
| `sglang_weights.py` | SGLang's weight verbs: a push's checks, its commit, the NCCL transport, the base digest |
| `sglang_digest.py` | SGLang's base digest, from the folder or tensors it was told to load, cast as it serves them |
| `vllm_engine.py` | vLLM (FARM_ENGINE=vllm): one server per replica in vLLM's own environment, over HTTP |
| `vllm_server.py` | the vLLM server process: its start, its Unix socket, its whole process group's end |
| `vllm_weights.py` | vLLM's weight verbs: loads by folder, each checked against a plain forward pass before it serves |
| `vllm_side/` | what runs in vLLM's environment: the launcher that ends with its replica, the worker extension |
| `loop_thread.py` | an event loop on its own thread, where an engine's client lives (SGLang, vLLM) |
| `auto.py` | FARM_ENGINE=auto: SGLang on CUDA; on CPU vLLM for a real model when installed, else torch |
| `bench_engine.py` | fixed latency per decode step and no model: for benchmarks and tests of the service layer |
| `stats.py` | EngineStats: busy time, batch sizes, prefill and draft token counts |

A user engine subclasses Engine and is named by dotted path, `my_pkg.engines:MyEngine`, with its module listed
in FARM_PLUGINS (or registered by name from a FARM_PLUGINS module with `@ENGINES.register("mine")`).
"""

from rollout_farm.services.engine import bench_engine, sglang_engine, torch, vllm_engine  # noqa: F401  (they register)
from rollout_farm.services.engine.base import ENGINES, Engine, EngineOutput
from rollout_farm.services.errors import EngineVerbMissing
from rollout_farm.services.weights.checks import WeightsRejected

__all__ = ["ENGINES", "Engine", "EngineOutput", "EngineVerbMissing", "WeightsRejected"]
