"""A stand-in for a GPU engine, for benchmarks of the service layer only.

Each decode step of a batch sleeps a fixed `token_latency_s`, whatever the batch size (as on a
GPU that is far from saturated), and yields random tokens. No model runs, so what a benchmark
measures on top of `max_new_tokens * token_latency_s` is the cost of the service itself.
"""

from __future__ import annotations

import math
import random
import threading
import time

import torch
from transformers import AutoTokenizer

from services.engine.base import Engine, EngineOutput, InFlightPolicy, WeightsRejected
from services.protocol import SamplingParams


class BenchEngine(Engine):
    def __init__(self, model_path: str, token_latency_s: float = 0.01):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.token_latency_s = token_latency_s
        self.weight_version, self.generated_tokens, self.busy = 0, 0, False
        self._admit, self._lock, self._epoch, self._staged = threading.Event(), threading.Lock(), 0, None
        self._admit.set()
        self.vocab = len(self.tokenizer)

    def generate(self, prompts: list[list[int]], params: SamplingParams, cancel: threading.Event | None = None) -> list[EngineOutput]:
        self._admit.wait()
        rng = random.Random(params.seed)
        with self._lock:
            self.busy, epoch, steps, reason = True, self._epoch, 0, "length"
            for steps in range(1, params.max_new_tokens + 1):
                time.sleep(self.token_latency_s)
                if self._epoch != epoch or (cancel is not None and cancel.is_set()):
                    reason = "abort"
                    break
            self.busy = False
        self.generated_tokens += steps * len(prompts)
        lp = -math.log(self.vocab)
        return [EngineOutput([rng.randrange(self.vocab) for _ in range(steps)], [lp] * steps, reason, self.weight_version, [self.weight_version] * steps)
                for _ in prompts]

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

    def health_token_id(self) -> int:
        return 0
