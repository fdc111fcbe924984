"""Engines: the small lifecycle interface and its implementations (torch on CPU/CUDA; SGLang later)."""

from services.engine.base import Engine, EngineOutput, WeightsRejected

__all__ = ["Engine", "EngineOutput", "WeightsRejected"]
