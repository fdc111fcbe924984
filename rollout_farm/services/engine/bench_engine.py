"""A stand-in for a GPU engine, for benchmarks and tests of the service layer.

Each decode step sleeps a fixed `token_latency_s` (FARM_BENCH_TOKEN_LATENCY_S), whatever the batch size (as on a GPU
that is far from saturated), and yields random tokens. Concurrent generate calls share the steps, as they share
batches on a real engine: one clock thread ticks every token_latency_s while any call runs, and each tick is one
token for every call that was waiting when it began (a call that arrives mid-tick starts at the next one). No model
runs and none is needed: it uses the tokenizer of the model folder it is given, or the embedded byte tokenizer. So
what a benchmark measures on top of `max_new_tokens * token_latency_s` is the cost of the service itself.

Weight commits follow the in-flight policy as the torch engine's do, for the versions each token records: with
"partial" the calls in flight go on on the new version (a sample spans both), with "abort" they end at the next tick
("abort": the replica runs them again), and with "finish" (or a catch-up) they finish on the version they started
on, while new calls start on the new one (no weights, so nothing waits for them).
"""

from __future__ import annotations

import math
import pathlib
import random
import threading
import time

import torch

from rollout_farm.services.engine.base import ENGINES, Engine, EngineOutput
from rollout_farm.services.protocol import InFlightPolicy, SamplingParams
from rollout_farm.services.weights.checks import WeightsRejected


class _Run:
    """One generate call on the clock: its rows, its limit, and the steps done."""

    def __init__(self, rows: int, limit: int, cancel: threading.Event | None, epoch: int, tick: int, version: int):
        self.rows, self.limit, self.cancel, self.epoch, self.joined = rows, limit, cancel, epoch, tick
        self.steps, self.reason, self.done = 0, "length", threading.Event()
        self.version, self.versions = version, []  # the version it generates on; each token's


@ENGINES.register("bench")
class BenchEngine(Engine):
    needs_model = False
    concurrent_generate = True  # generate merges concurrent calls: the replica calls it from a thread per call

    def __init__(self, model_path: str | None = None, token_latency_s: float = 0.01):
        if model_path and (pathlib.Path(model_path) / "config.json").exists():
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        else:
            from rollout_farm.services.models import byte_tokenizer

            self.tokenizer = byte_tokenizer()
        self.token_latency_s = token_latency_s
        self.weight_version, self.generated_tokens = 0, 0
        self._epoch, self._staged = 0, None
        self._clock = threading.Condition()  # guards the three below
        self._runs: list[_Run] = []
        self._tick, self._ticking = 0, False  # the tick in progress; whether the clock thread runs
        self.vocab = len(self.tokenizer)

    @classmethod
    def from_settings(cls, model_path, settings, threads) -> BenchEngine:
        return cls(model_path, settings.bench_token_latency_s)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, cancel: threading.Event | None = None
    ) -> list[EngineOutput]:
        if not self._wait_admitted(cancel):
            return self._cancelled_before_start(prompts)
        rng = random.Random(params.seed)
        run = _Run(len(prompts), params.max_new_tokens, cancel, self._epoch, 0, self.weight_version)
        if prompts:
            with self._clock:
                run.joined, run.version = self._tick, self.weight_version
                self._runs.append(run)
                if not self._ticking:
                    self._ticking = True
                    threading.Thread(target=self._ticks, name="bench-clock", daemon=True).start()
            run.done.wait()
        steps = run.steps
        self.generated_tokens += steps * len(prompts)
        lp = -math.log(self.vocab)
        v = run.versions[0] if steps else run.version
        return [
            EngineOutput([rng.randrange(self.vocab) for _ in range(steps)], [lp] * steps, run.reason, v, run.versions)
            for _ in prompts
        ]

    def _ticks(self) -> None:
        """The clock: one decode step per token_latency_s for every run that was waiting when the step began; it
        stops when no run is left (the next call starts it again)."""
        self.stats.busy(True)
        while True:
            with self._clock:
                self._tick += 1
                tick = self._tick
            time.sleep(self.token_latency_s)
            with self._clock:
                stepped = [r for r in self._runs if r.joined < tick]
                for r in stepped:
                    r.steps += 1
                    r.versions.append(r.version)
                    if self._epoch != r.epoch or (r.cancel is not None and r.cancel.is_set()):
                        r.reason = "abort"
                    if r.reason == "abort" or r.steps >= r.limit:
                        r.done.set()
                if stepped:
                    self.stats.step(sum(r.rows for r in stepped), len(stepped))
                self._runs = [r for r in self._runs if not r.done.is_set()]
                if not self._runs:
                    self._ticking = False
                    self.stats.busy(False)
                    return

    def weight_spec(self) -> dict[str, tuple[list[int], str]]:
        return {"bench.weight": ([1], "F32")}

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if problems := self._version_problems(version):
            raise WeightsRejected("; ".join(problems))
        self._staged = (version, None)  # no weights: only the version

    def _commit_staged(self, version: int, policy: InFlightPolicy | None) -> None:
        """The new version, for new calls and (by the policy) for the calls in flight; nothing waits."""
        with self._clock:
            self.weight_version, self._staged = version, None
            if policy == "partial":
                for r in self._runs:
                    r.version = version
            elif policy == "abort":
                self._epoch += 1

    def discard_weights(self, version: int) -> None:
        """Drop what was staged, whatever its version."""
        self._staged = None

    def abort(self) -> None:
        self._epoch += 1

    @property
    def busy(self) -> bool:
        return bool(self._runs)

    def health_token_id(self) -> int:
        return 0
