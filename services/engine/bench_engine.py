"""A stand-in for a GPU engine, for benchmarks and tests of the service layer.

Each decode step of a batch sleeps a fixed `token_latency_s` (FARM_BENCH_TOKEN_LATENCY_S), whatever the batch size
(as on a GPU that is far from saturated), and yields random tokens. No model runs and none is needed: it uses
the tokenizer of the model folder it is given, or the embedded byte tokenizer. So what a benchmark measures on
top of `max_new_tokens * token_latency_s` is the cost of the service itself.
"""

from __future__ import annotations

import math
import pathlib
import random
import threading
import time

import torch

from services.engine.base import ENGINES, Engine, EngineOutput, WeightsRejected
from services.protocol import InFlightPolicy, SamplingParams


@ENGINES.register("bench")
class BenchEngine(Engine):
    needs_model = False

    def __init__(self, model_path: str | None = None, token_latency_s: float = 0.01):
        if model_path and (pathlib.Path(model_path) / "config.json").exists():
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        else:
            from services.models import byte_tokenizer

            self.tokenizer = byte_tokenizer()
        self.token_latency_s = token_latency_s
        self.weight_version, self.generated_tokens, self._busy = 0, 0, False
        self._admit, self._lock, self._epoch, self._staged = threading.Event(), threading.Lock(), 0, None
        self._admit.set()
        self.vocab = len(self.tokenizer)

    @classmethod
    def from_settings(cls, model_path, settings, threads) -> BenchEngine:
        return cls(model_path, settings.bench_token_latency_s)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, cancel: threading.Event | None = None
    ) -> list[EngineOutput]:
        self._admit.wait()
        rng = random.Random(params.seed)
        with self._lock:
            self._busy, epoch, steps, reason = True, self._epoch, 0, "length"
            for steps in range(1, params.max_new_tokens + 1):
                time.sleep(self.token_latency_s)
                if self._epoch != epoch or (cancel is not None and cancel.is_set()):
                    reason = "abort"
                    break
            self._busy = False
        self.generated_tokens += steps * len(prompts)
        lp = -math.log(self.vocab)
        v = self.weight_version
        return [
            EngineOutput([rng.randrange(self.vocab) for _ in range(steps)], [lp] * steps, reason, v, [v] * steps)
            for _ in prompts
        ]

    def weight_spec(self) -> dict[str, tuple[list[int], str]]:
        return {"bench.weight": ([1], "F32")}

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if version <= self.weight_version:
            raise WeightsRejected(f"version {version} is not newer than the served version {self.weight_version}")
        self._staged = version

    def commit_weights(self, version: int, policy: InFlightPolicy | None = "finish") -> None:
        if version <= self.weight_version:
            return
        if self._staged != version:
            raise WeightsRejected(f"version {version} is not staged on this replica")
        self.weight_version, self._staged = version, None

    def discard_weights(self, version: int) -> None:
        self._staged = None

    def pause(self) -> None:
        self._admit.clear()

    def resume(self) -> None:
        self._admit.set()

    def abort(self) -> None:
        self._epoch += 1

    @property
    def paused(self) -> bool:
        return not self._admit.is_set()

    @property
    def busy(self) -> bool:
        return self._busy

    def health_token_id(self) -> int:
        return 0
