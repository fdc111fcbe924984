"""A PyTorch engine for any HF causal LM: batched sampling with a KV cache, on CPU or CUDA. Concurrent generate
calls share its batches: scheduler.py decodes them together, joining new calls at step boundaries.

Logprobs are those of the raw model: log_softmax of the logits at temperature 1,
before top-k/top-p. That is pi_old(token | prefix), the quantity the PPO ratio
needs, and what the trainer recomputes with a plain forward pass. The logprobs of
the distribution actually sampled (after temperature, top-k, top-p) come too, as
`sampling_logprobs`, for importance weights (0 when greedy). A `regex` in the
sampling params constrains the text token by token (sampling.RegexMask); the sampling
logprobs are then the constrained q (the processed logprob minus log Z over the allowed
tokens, `RegexMask.log_allowed_mass`), and none past its check limit.

TorchEngine builds its parts and gives each what it uses: the served model (model.py) to all of them; the session
and prompt caches to the Prefill (prefill.py); the History to the Drafter (draft_step.py); those two, the Hold
(hold.py), the Draws (sampling.py) and the admit gate to the Scheduler (scheduler.py). Its verbs delegate to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from operator import attrgetter
from typing import TYPE_CHECKING

import torch

from rollout_farm.services.engine.base import (
    ENGINES,
    HEALTH_PARAMS,
    AdapterNotResident,
    Engine,
    EngineOutput,
    ScoredTokens,
    cancellable,
    checked_health_token,
)
from rollout_farm.services.engine.torch.draft_step import Drafter
from rollout_farm.services.engine.torch.hold import HOLD_MODES, Hold
from rollout_farm.services.engine.torch.model import ServedModel
from rollout_farm.services.engine.torch.prefill import Prefill
from rollout_farm.services.engine.torch.sampling import Draws
from rollout_farm.services.engine.torch.scheduler import Scheduler
from rollout_farm.services.engine.torch.session_cache import SessionKV
from rollout_farm.services.engine.torch.speculative import History
from rollout_farm.services.protocol import InFlightPolicy, SamplingParams
from rollout_farm.services.weights.checks import WeightsRejected, check_state_dict, non_finite
from rollout_farm.services.weights.state_dict import spec_of

if TYPE_CHECKING:
    from rollout_farm.services.config.settings import ServiceSettings

MAX_BATCH_SIZE = 256  # rows decoded at once (FARM_ENGINE_MAX_BATCH_SIZE)
BATCH_WINDOW_S = 0.005  # how long an idle engine waits for more calls after one arrives (FARM_ENGINE_BATCH_WINDOW_S)
SESSION_CACHE_BYTES = 1 << 30  # KV cache kept for sessions between turns (FARM_ENGINE_SESSION_CACHE_BYTES)
PROMPT_CACHE_BYTES = 256 << 20  # KV cache kept for prompts' next calls (FARM_ENGINE_PROMPT_CACHE_BYTES)


@ENGINES.register("torch")
class TorchEngine(Engine):
    """Owns its parts: `served` (ServedModel), `session_kv` (which forget_session empties too), `history` (None:
    no speculative decoding), `hold` and `scheduler`."""

    keeps_sessions = True  # generate takes a cache_key (Engine.keeps_sessions)
    serves_adapters = True  # generate takes an adapter key (Engine.serves_adapters; lora.py)

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: str = "float32",
        threads: int | None = None,
        max_batch_size: int = MAX_BATCH_SIZE,
        batch_window_s: float = BATCH_WINDOW_S,
        session_cache_bytes: int = SESSION_CACHE_BYTES,
        prompt_cache_bytes: int = PROMPT_CACHE_BYTES,
        share_prompts: bool = True,
        speculative_tokens: int = 0,
    ):
        if threads:
            torch.set_num_threads(threads)
        self.served = ServedModel(model_path, device, dtype)
        self.session_kv = SessionKV(session_cache_bytes)
        prompt_kv = SessionKV(prompt_cache_bytes)  # a prompt's cache for its next call
        # False: every row prefills its own prompt (the tests' and bench's baseline)
        prefill = Prefill(self.served, self.session_kv, prompt_kv, share_prompts, self.stats)
        draws = Draws(self.served.device)
        self.history = History() if speculative_tokens else None
        drafter = None
        if speculative_tokens:
            drafter = Drafter(self.served, self.history, speculative_tokens, draws, self.stats)
        self.hold = Hold()
        self.scheduler = Scheduler(
            self.served,
            prefill,
            self.hold,
            drafter,
            draws,
            self._gate(),
            self.stats,
            max_batch_size,
            batch_window_s,
            threads,
            self._rows_to_keep,
        )

    @classmethod
    def from_settings(cls, model_path: str, settings: ServiceSettings, threads: int | None) -> TorchEngine:
        return cls(
            model_path,
            device=settings.device,
            dtype=settings.dtype,
            threads=threads,
            max_batch_size=settings.engine_max_batch_size,
            batch_window_s=settings.engine_batch_window_s,
            session_cache_bytes=settings.engine_session_cache_bytes,
            prompt_cache_bytes=settings.engine_prompt_cache_bytes,
            speculative_tokens=settings.engine_speculative_tokens,
        )

    # what the service reads: its parts' state, read through (eos_ids: set[int], held: HoldMode | None) ----------
    model = property(attrgetter("served.model"))
    tokenizer = property(attrgetter("served.tokenizer"))
    eos_ids = property(attrgetter("served.eos_ids"))
    pad_id = property(attrgetter("served.pad_id"))
    weight_version = property(attrgetter("served.version"))
    generated_tokens = property(attrgetter("scheduler.generated_tokens"))
    busy = property(attrgetter("scheduler.busy"))
    held = property(attrgetter("hold.mode"))

    # lifecycle -------------------------------------------------------------
    def pause(self, mode: str = "wait") -> None:
        """Engine.pause; with a HoldMode, also hold the running rows (hold.py)."""
        if mode == "wait":
            return super().pause()
        if mode not in HOLD_MODES:
            raise ValueError(f"pause mode {mode!r}: give one of wait, {', '.join(HOLD_MODES)}")
        super().pause()
        self.scheduler.hold_rows(mode)

    def resume(self) -> None:
        """Stop holding, open the admit gate and wake the scheduler, which admits the calls that waited."""
        self.scheduler.release_rows()
        super().resume()
        self.scheduler.wake()

    def abort(self) -> None:
        self.scheduler.abort()

    def health(self) -> int:
        """Sample one token (Engine.health), ahead of the queue: within a step or two however long the batch runs."""
        (out,) = self.scheduler.submit([[self.health_token_id()]], HEALTH_PARAMS, None, urgent=True).result()
        return checked_health_token(out)

    def vocab_size(self) -> int:
        return self.served.vocab_size()

    def health_token_id(self) -> int:
        return self.served.health_token_id()

    def context_length(self) -> int | None:
        return self.served.context_length()

    def score(self, sequences: list[list[int]], top_k: int, adapter: str | None = None) -> list[ScoredTokens]:
        with self.pinned(adapter):
            return self.served.score(sequences, top_k, adapter)

    # adapters (Engine.serves_adapters) -------------------------------------
    base_digest = property(attrgetter("served.digest"))

    def served_base(self) -> tuple[int, str]:
        return self.served.served()

    def stage_adapter(self, key: str, config, tensors: dict[str, torch.Tensor]) -> None:
        self.served.stage_adapter(key, config, tensors)

    def commit_adapter(self, key: str) -> None:
        self.served.commit_adapter(key)

    def discard_adapter(self, key: str) -> None:
        self.served.discard_adapter(key)

    def staged_adapter_bytes(self, key: str) -> int:
        return self.served.staged_adapter_bytes(key)

    def evict_adapter(self, key: str) -> bool:
        """Unload `key` now unless a call pins it (a replica's byte budget); False when one does."""
        return self.served.lora.evict(key)

    def base_digest_of(self, version: int) -> str | None:
        return self.served.digest_of(version)

    def score_staged_adapter(self, key: str, sequences: list[list[int]]) -> list[list[float | None]]:
        return self.served.score_staged_adapter(key, sequences)

    def score_staged_weights(self, version: int, sequences: list[list[int]]) -> list[list[float | None]]:
        return self.served.score_staged_weights(version, sequences)

    def retire_adapter(self, key: str) -> None:
        self.served.lora.retire(key)

    def resident_adapters(self, include_retiring: bool = False) -> dict[str, tuple[int, int]]:
        return self.served.lora.resident(include_retiring)

    @contextlib.contextmanager
    def pinned(self, adapter: str | None):
        """`adapter` stays resident while the block runs; AdapterNotResident when it is not resident now."""
        if adapter is None:
            yield
            return
        self._pin(adapter)
        try:
            yield
        finally:
            self.served.lora.unpin(adapter)

    def _pin(self, adapter: str) -> None:
        try:
            self.served.lora.pin(adapter)
        except KeyError:
            raise AdapterNotResident(adapter) from None

    # weights ---------------------------------------------------------------
    @property
    def _staged(self):
        """What Engine.commit_weights checks: the served model's staged (version, tensors)."""
        return self.served.staged

    def weight_spec(self) -> dict[str, tuple[list[int], str]]:
        return self.served.spec()

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        problems = check_state_dict(self.weight_spec(), spec_of(state_dict)) + non_finite(state_dict)
        problems += self._version_problems(version)
        if problems:
            raise WeightsRejected("; ".join(problems))
        self.served.stage(state_dict, version)

    def discard_weights(self, version: int) -> None:
        self.served.discard(version)

    def _commit_staged(self, version: int, policy: InFlightPolicy | None) -> None:
        """The scheduler applies the commit ("partial" at the next step, "finish" and "abort" once the batch is
        empty); this waits until it has, or the staged tensors were discarded."""
        self.scheduler.commit(version, policy)

    @staticmethod
    def _rows_to_keep(done: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Which of the batch's rows stay for the next step: the unfinished ones (a finished row leaves the batch
        and its KV cache). bench/engine_batching.py overrides it to measure the cost of keeping them."""
        return ~done[rows]

    # generation ------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event | None = None,
        cache_key: str | None = None,
        adapter: str | None = None,
    ) -> list[EngineOutput]:
        return self._submit(prompts, params, cancel, cache_key, adapter).result()

    async def agenerate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event | None = None,
        cache_key: str | None = None,
        adapter: str | None = None,
    ) -> list[EngineOutput]:
        """generate without a thread: the call waits in the scheduler's queue, the caller on its future. Cancelling
        the awaiting task sets `cancel`, so the call's rows leave the batch at the next step. `cache_key` (a
        session's id, one prompt): start from the KV cache the key's last call left, and leave one
        (session_cache.py). `adapter`: a resident adapter's key, pinned until the call ends (AdapterNotResident when
        it is not resident)."""
        cancel = cancel or threading.Event()
        future = self._submit(prompts, params, cancel, cache_key, adapter)
        return await cancellable(asyncio.wrap_future(future), cancel)

    def _submit(self, prompts, params, cancel, cache_key, adapter):
        """The call queued, its adapter pinned until its outputs are set (its rows have left the batch then)."""
        if adapter is None:
            return self.scheduler.submit(prompts, params, cancel, cache_key=cache_key)
        self._pin(adapter)
        future = self.scheduler.submit(prompts, params, cancel, cache_key=cache_key, adapter=adapter)
        future.add_done_callback(lambda _: self.served.lora.unpin(adapter))
        return future

    def forget_session(self, key: str) -> None:
        self.session_kv.forget(key)
