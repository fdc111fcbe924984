"""Engines: the small lifecycle interface and its implementations.

torch   any HF causal LM, on CPU or CUDA (the default; what CI and development use)
sglang  SGLang's offline engine on GPUs (the optional `sglang` extra)
bench   fixed latency per decode step and no model: for benchmarks of the service layer
"""

from services.engine.base import Engine, EngineOutput, InFlightPolicy, WeightsRejected

__all__ = ["Engine", "EngineOutput", "InFlightPolicy", "WeightsRejected", "make_engine"]


def make_engine(kind: str, model_path: str, device: str, dtype: str, threads: int | None, token_latency_s: float) -> Engine:
    if kind == "sglang":
        from services.engine.sglang_engine import SGLangEngine

        return SGLangEngine(model_path, device, dtype, threads)
    if kind == "bench":
        from services.engine.bench_engine import BenchEngine

        return BenchEngine(model_path, token_latency_s)
    from services.engine.torch_engine import TorchEngine

    return TorchEngine(model_path, device, dtype, threads)
