"""A PyTorch engine for any HF causal LM: batched sampling with a KV cache, on CPU or CUDA. Concurrent generate
calls share its batches: torch_scheduler.py decodes them together, joining new calls at step boundaries.

Logprobs are those of the raw model: log_softmax of the logits at temperature 1,
before top-k/top-p. That is pi_old(token | prefix), the quantity the PPO ratio
needs, and what the trainer recomputes with a plain forward pass. The logprobs of
the distribution actually sampled (after temperature, top-k, top-p) come too, as
`sampling_logprobs`, for importance weights (0 when greedy). A `regex` in the
sampling params constrains the text token by token (RegexMask); the sampling
logprobs stay those of the unconstrained distribution (-inf for a token that the
constraint forced outside it).
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_farm.services.engine.base import (
    ENGINES,
    HEALTH_PARAMS,
    Engine,
    EngineOutput,
    ScoredTokens,
    cancellable,
    checked_health_token,
)
from rollout_farm.services.engine.torch_sampling import RegexMask, processed_logits, text_hits_stop  # noqa: F401  (their home)
from rollout_farm.services.engine.torch_scheduler import BatchScheduler
from rollout_farm.services.engine.torch_session_cache import SessionKV
from rollout_farm.services.engine.torch_speculative import History
from rollout_farm.services.protocol import InFlightPolicy, SamplingParams
from rollout_farm.services.weights.checks import WeightsRejected, check_state_dict, non_finite
from rollout_farm.services.weights.state_dict import canonical_state_dict, spec_of

if TYPE_CHECKING:
    from rollout_farm.services.settings import ServiceSettings

MAX_BATCH_SIZE = 256  # rows decoded at once (FARM_ENGINE_MAX_BATCH_SIZE)
BATCH_WINDOW_S = 0.005  # how long an idle engine waits for more calls after one arrives (FARM_ENGINE_BATCH_WINDOW_S)
SESSION_CACHE_BYTES = 1 << 30  # KV cache kept for sessions between turns (FARM_ENGINE_SESSION_CACHE_BYTES)
PROMPT_CACHE_BYTES = 256 << 20  # KV cache kept for prompts' next calls (FARM_ENGINE_PROMPT_CACHE_BYTES)


@ENGINES.register("torch")
class TorchEngine(BatchScheduler, Engine):
    keeps_sessions = True  # generate takes a cache_key (Engine.keeps_sessions)

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
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device).eval()
        )
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = set(eos) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.weight_version = 0
        self._lock = threading.Lock()  # the model: one decode step, scoring pass or weight update at a time
        self._abort_epoch = 0  # bumped by abort() and by an "abort" commit: running calls compare at each step
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._commit: InFlightPolicy | None = None  # the policy of a commit waiting to be applied
        self.generated_tokens = 0
        self.session_kv = SessionKV(session_cache_bytes)
        self.prompt_kv = SessionKV(prompt_cache_bytes)  # a prompt's cache for its next call (torch_scheduler.py)
        self.share_prompts = share_prompts  # False: every row prefills its own prompt (the tests' and bench's baseline)
        self.speculative_tokens = speculative_tokens  # torch_draft_step.py
        self.history = History() if speculative_tokens else None
        self._start_scheduler(threads, max_batch_size, batch_window_s)

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

    # lifecycle -------------------------------------------------------------
    def resume(self) -> None:
        """Open the admit gate and wake the scheduler, which admits the calls that waited (Engine.pause)."""
        super().resume()
        self._wake()

    def abort(self) -> None:
        self._abort_epoch += 1

    @property
    def busy(self) -> bool:
        return bool(self._active)

    def health(self) -> int:
        """Sample one token (Engine.health), ahead of the queue: within a step or two however long the batch runs."""
        (out,) = self._submit([[self.health_token_id()]], HEALTH_PARAMS, None, urgent=True).result()
        return checked_health_token(out)

    def vocab_size(self) -> int:
        return max(len(self.tokenizer), self.model.config.vocab_size)

    def health_token_id(self) -> int:
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.pad_id

    def context_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def score(self, sequences: list[list[int]], top_k: int) -> list[ScoredTokens]:
        """One forward pass per sequence, under the lock, on the weights being served."""
        out = []
        with self._lock, torch.inference_mode():
            for ids in sequences:
                x = torch.tensor([ids], dtype=torch.long, device=self.device)
                logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), -1)  # position j predicts j+1
                chosen = logp.gather(-1, x[0, 1:, None]).squeeze(-1).tolist()
                top = torch.topk(logp, top_k, -1) if top_k else None
                alts = [list(zip(i.tolist(), v.tolist())) for v, i in zip(*top)] if top else [[] for _ in chosen]
                out.append(ScoredTokens([None, *chosen], [[], *alts]))
        return out

    # weights ---------------------------------------------------------------
    def weight_spec(self) -> dict[str, tuple[list[int], str]]:
        return spec_of(canonical_state_dict(self.model))

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        problems = check_state_dict(self.weight_spec(), spec_of(state_dict)) + non_finite(state_dict)
        problems += self._version_problems(version)
        if problems:
            raise WeightsRejected("; ".join(problems))
        self._staged = (version, {n: t.to(self.device) for n, t in state_dict.items()})

    def _commit_staged(self, version: int, policy: InFlightPolicy | None) -> None:
        """Hand the commit to the scheduler and wait until it has applied it (or the staged tensors were discarded)."""
        with self._cv:
            if policy is not None or self._commit is None:  # a catch-up (None) does not override a push's policy
                self._commit = policy or "finish"
            if policy == "abort":
                self._abort_epoch += 1
            # the scheduler applies it: "partial" at the next step, "finish" and "abort" once the batch is empty
            self._cv.notify_all()
            while self.weight_version < version and self._commit is not None:
                self._cv.wait(0.05)

    def _apply_staged(self) -> None:
        """Copy the staged tensors into the model (the scheduler thread, holding self._lock). A commit whose tensors
        were discarded meanwhile is dropped: its waiter returns."""
        staged = self._staged
        if staged is not None:
            version, tensors = staged
            with torch.no_grad():
                params = canonical_state_dict(self.model)
                for name, t in tensors.items():
                    params[name].copy_(t)
            self.weight_version, self._staged = version, None
        self._commit = None  # after the version: a waiter that sees no commit sees the new version

    # generation ------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event | None = None,
        cache_key: str | None = None,
    ) -> list[EngineOutput]:
        return self._submit(prompts, params, cancel, cache_key=cache_key).result()

    async def agenerate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event | None = None,
        cache_key: str | None = None,
    ) -> list[EngineOutput]:
        """generate without a thread: the call waits in the scheduler's queue, the caller on its future. Cancelling
        the awaiting task sets `cancel`, so the call's rows leave the batch at the next step. `cache_key` (a
        session's id, one prompt): start from the KV cache the key's last call left, and leave one
        (torch_session_cache.py)."""
        cancel = cancel or threading.Event()
        future = self._submit(prompts, params, cancel, cache_key=cache_key)
        return await cancellable(asyncio.wrap_future(future), cancel)

    def forget_session(self, key: str) -> None:
        self.session_kv.forget(key)
