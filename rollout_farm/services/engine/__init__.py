"""Engines: the lifecycle interface (base.py) and one registry of implementations.

torch   any HF causal LM, on CPU or CUDA (the default; what CI and development use)
sglang  SGLang's offline engine on GPUs (the optional `sglang` extra, imported when the engine starts)
bench   fixed latency per decode step and no model: for benchmarks and tests of the service layer

A user engine subclasses Engine and is named by dotted path, `my_pkg.engines:MyEngine`, with its module listed
in FARM_PLUGINS (or registered by name from a FARM_PLUGINS module with `@ENGINES.register("mine")`).
"""

from rollout_farm.services.engine import bench_engine, sglang_engine, torch_engine  # noqa: F401  (they register themselves)
from rollout_farm.services.engine.base import ENGINES, Engine, EngineOutput
from rollout_farm.services.errors import EngineVerbMissing
from rollout_farm.services.weights.checks import WeightsRejected

__all__ = ["ENGINES", "Engine", "EngineOutput", "EngineVerbMissing", "WeightsRejected"]
