"""The engine boundary: every verb the service calls, shaped after SGLang's lifecycle verbs.

generate         token ids in; token ids, raw-model logprobs, per-token weight versions and a finish reason out
agenerate        the same, awaited: the replica awaits every rollout's calls at once, so an engine that batches
                 merges concurrent calls (the torch and bench engines batch them; SGLang batches them itself)
weight_spec      the tensors an update must carry
stage_weights    check a state dict against the model and hold it, next to the served weights
stage_weights_from_path   the same from a folder of safetensors files (shared storage)
commit_weights   serve the staged weights as the new version; `policy` says what happens to in-flight samples:
                   finish   they end on the old weights; the commit waits for them
                   abort    they end with finish_reason "abort" at their next token (the caller retries them)
                   partial  they go on with the new weights from their next token (see token_versions)
discard_weights  drop what was staged (another replica refused it)
pause / resume   stop and restart admitting new generate calls (`paused` says which); a generate call that waits
                 at the gate ends "abort" with no tokens if its `cancel` is set first. pause(mode): "in_place" and
                 "retract" also hold the running rows (SGLang's modes; the torch engine, torch/hold.py)
abort            end every in-flight generate call at its next token ("abort")
health           prove the engine can sample one token (temperature 1)
stage_adapter / commit_adapter / discard_adapter / retire_adapter
                 LoRA adapters under never-reused keys ("name@vN"): checked and held, made resident, dropped, or
                 unloaded once no call uses it (serves_adapters; generate's `adapter` names a resident key)
init_weights_update_group / update_weights_from_distributed
                 the NCCL transport (SGLang); an engine without it raises EngineVerbMissing, a 501 naming the engine
State read by the service: weight_version, paused, busy, generated_tokens, stats (busy time, batch sizes: stats.py),
tokenizer, vocab_size().

What Engine does for every engine: commit_weights checks the version (served already: a no-op; not staged:
WeightsRejected) and hands the rest to the engine's _commit_staged; discard_weights drops `_staged`, the
(version, weights) pair that stage_weights holds; pause, resume and paused open and close one admit gate, which
a generate call waits at (_wait_admitted) or a scheduler reads (`paused`); cancellable() awaits an engine call
so that cancelling the caller sets the call's `cancel` event.

Engines are registered by name in ENGINES (rollout_farm/services/engine/__init__.py); a dotted path `pkg.module:Class`
whose module is in FARM_PLUGINS works too. The service builds one with `Engine.from_settings`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import math
import pathlib
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch

from rollout_farm.services.engine.stats import EngineStats
from rollout_farm.services.errors import EngineVerbMissing
from rollout_farm.services.extensions.registry import Registry
from rollout_farm.services.protocol import FinishReason, InFlightPolicy, SamplingParams
from rollout_farm.services.weights.checks import WeightsRejected

if TYPE_CHECKING:
    from rollout_farm.services.config.settings import ServiceSettings


class AdapterNotResident(KeyError):
    """generate named an adapter key this engine does not hold (never loaded, evicted or retired)."""


@dataclass
class EngineOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int  # the version of the first token (the oldest one)
    token_versions: list[int] = field(default_factory=list)  # one per token; differ only under the "partial" policy
    # per token, under the distribution sampled (temperature, top-k/p; 0 when greedy); None: the engine cannot tell
    sampling_logprobs: list[float] | None = None
    draft_tokens: int = 0  # speculative decoding: drafted tokens verified for this sample, and those accepted
    draft_accepted: int = 0


@dataclass
class ScoredTokens:
    logprobs: list[float | None]  # one per token; None for the first (nothing predicts it)
    top: list[list[tuple[int, float]]]  # per token: the top_k (token id, logprob) of its position, [] for the first


def read_safetensors_folder(path: str | pathlib.Path) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in a folder (sharded checkpoints included)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


T = TypeVar("T")
GENERATE_THREADS = 1024  # most generate calls a concurrent engine's default agenerate runs at once (threads on demand)
_callers: ThreadPoolExecutor | None = None


def generate_threads() -> ThreadPoolExecutor:
    """The threads that Engine.agenerate's default blocks in, one per call in flight, for an engine whose generate
    merges concurrent calls: not the event loop's default executor, whose few threads would cap the merging."""
    global _callers
    if _callers is None:
        _callers = ThreadPoolExecutor(GENERATE_THREADS, thread_name_prefix="generate")
    return _callers


async def cancellable(work: Awaitable[T], cancel: threading.Event) -> T:
    """Await `work` shielded from cancellation: cancelling the awaiting task sets `cancel` instead (the engine ends
    the call at its next token) and re-raises; the work's outcome is then retrieved, so no warning is logged."""
    future = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel.set()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning in the log
        raise


ADMIT_POLL_S = 0.05  # how often a generate call waiting at a paused engine's gate looks at its cancel event


def _open_gate() -> threading.Event:
    gate = threading.Event()
    gate.set()
    return gate


class Engine(abc.ABC):
    needs_model: ClassVar[bool] = True  # False: runs without model weights (the bench engine)
    # True: generate is thread-safe and merges concurrent calls (the bench engine); False: the default agenerate
    # runs every generate call on the engine's one thread, one at a time, as engines written for one thread expect
    concurrent_generate: ClassVar[bool] = False
    ranks_per_engine: ClassVar[int] = 1  # NCCL ranks one engine takes in the trainer's group
    # True: generate and agenerate take `cache_key` (a session's id) and keep its KV cache between turns (torch);
    # forget_session(key) drops it
    keeps_sessions: ClassVar[bool] = False
    # True: generate, agenerate and score take `adapter` (a resident adapter's key) and the adapter verbs work
    serves_adapters: ClassVar[bool] = False
    base_digest: str | None = None  # the served base weights' policy digest; None: the engine cannot hash them
    weight_version: int = 0
    generated_tokens: int = 0  # since the engine started
    tokenizer = None  # a Hugging Face tokenizer: the service tokenizes, decodes and renders chat with it
    _staged: tuple[int, object] | None = None  # (version, what stage_weights holds for commit_weights)

    @classmethod
    def from_settings(cls, model_path: str, settings: ServiceSettings, threads: int | None) -> Engine:
        """The engine a replica runs, built from the service settings (FARM_DEVICE, FARM_DTYPE, ...)."""
        return cls(model_path, device=settings.device, dtype=settings.dtype, threads=threads)

    # generation -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, cancel: threading.Event | None = None
    ) -> list[EngineOutput]:
        """One output per prompt, in order. Logprobs are of the raw model (temperature 1, no top-p/k).
        Setting `cancel` ends the call at its next token, with finish_reason "abort"."""

    async def agenerate(
        self, prompts: list[list[int]], params: SamplingParams, cancel: threading.Event | None = None
    ) -> list[EngineOutput]:
        """generate, awaited. This default runs it on the engine's one thread (engine_thread()), one call at a time;
        with concurrent_generate, on a thread of its own per call (generate_threads()), so that concurrent calls
        reach generate together and it can merge them. An engine with its own scheduler (torch) or an async API
        (SGLang) overrides this and holds no thread."""
        pool = generate_threads() if self.concurrent_generate else self.engine_thread()
        return await asyncio.get_running_loop().run_in_executor(pool, self.generate, prompts, params, cancel)

    def engine_thread(self) -> ThreadPoolExecutor:
        """The one thread the replica runs this engine's blocking verbs on (scoring, health; generate too by
        default), created on first use."""
        return self._own("_engine_thread", lambda: ThreadPoolExecutor(1, thread_name_prefix="engine"))

    @property
    def stats(self) -> EngineStats:
        """Busy time and batch sizes (rollout_farm/services/engine/stats.py)."""
        return self._own("_stats", EngineStats)

    def _own(self, name: str, make: Callable[[], T]) -> T:
        """The attribute `name`, made by make() on first use, so that a user engine needs no Engine.__init__ call."""
        found = self.__dict__.get(name)
        return found if found is not None else self.__dict__.setdefault(name, make())

    def _cancelled_before_start(self, prompts: list[list[int]]) -> list[EngineOutput]:
        """The outputs of a call cancelled before it started: "abort" with no tokens, on the served version."""
        return [EngineOutput([], [], "abort", self.weight_version, []) for _ in prompts]

    def vocab_size(self) -> int:
        """Token ids a prompt may use: [0, vocab_size)."""
        return max(len(self.tokenizer), self.tokenizer.vocab_size)

    # weights --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def weight_spec(self) -> dict[str, tuple[list[int], str]]:
        """The tensors an update must carry: name -> (shape, safetensors dtype)."""

    @abc.abstractmethod
    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Check and hold `state_dict` as `version`, or raise WeightsRejected; the served weights do not change."""

    def stage_weights_from_path(self, path: str, version: int) -> None:
        """Stage the safetensors files of a folder (an engine that reads the folder itself overrides this)."""
        self.stage_weights(read_safetensors_folder(path), version)

    def commit_weights(self, version: int, policy: InFlightPolicy | None = "finish") -> None:
        """Serve the weights staged as `version` (_commit_staged); a no-op when it is served already, WeightsRejected
        when it is not staged. With policy None (a replica catching up) a commit of the same version already under
        way keeps its policy."""
        # already served: a replica's catch-up and the push's own commit can both land
        if version <= self.weight_version:
            return
        if self._staged is None or self._staged[0] != version:
            raise WeightsRejected(f"version {version} is not staged on this replica")
        self._commit_staged(version, policy)

    def _commit_staged(self, version: int, policy: InFlightPolicy | None) -> None:
        """Serve `self._staged`, which holds `version`, newer than the served one (commit_weights checked both);
        `policy` as in commit_weights. An engine implements this, or commit_weights itself (as engines written
        before this template did)."""
        raise NotImplementedError(
            f"the {type(self).__name__} engine implements neither _commit_staged nor commit_weights"
        )

    def discard_weights(self, version: int) -> None:
        """Drop the weights staged as `version`, if any."""
        if self._staged is not None and self._staged[0] == version:
            self._staged = None

    def _version_problems(self, version: int) -> list[str]:
        """Why `version` cannot be staged: [] when it is newer than the served one."""
        if version <= self.weight_version:
            return [f"version {version} is not newer than the served version {self.weight_version}"]
        return []

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        """Join the trainer's NCCL group at rank rank_offset (SGLang's init_weights_update_group)."""
        raise EngineVerbMissing.of(
            self, "NCCL weight transport (init_weights_update_group)", "run FARM_ENGINE=sglang on GPUs"
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        group_name: str = "weight_update_group",
    ) -> None:
        """Receive the tensors the trainer broadcasts and serve them as `version`."""
        raise EngineVerbMissing.of(
            self, "NCCL weight transport (update_weights_from_distributed)", "run FARM_ENGINE=sglang on GPUs"
        )

    # lifecycle ------------------------------------------------------------------------------------
    def pause(self, mode: str = "wait") -> None:
        """Close the admit gate: new generate calls wait until resume; running ones go on ("wait"). The modes
        "in_place" (hold the running rows at a step boundary, keeping their KV cache) and "retract" (put them back
        in the waiting queue, to continue from prompt + tokens so far) are SGLang's; an engine whose scheduler can
        hold rows overrides this (torch: torch/hold.py), the others refuse them (501)."""
        if mode != "wait":
            raise EngineVerbMissing.of(
                self,
                f"pause mode {mode!r} (holding running requests)",
                "pause with mode 'abort', or use FARM_ENGINE=torch",
            )
        self._gate().clear()

    def resume(self) -> None:
        """Open the admit gate (an engine whose scheduler waits for it extends this to wake the scheduler)."""
        self._gate().set()

    @property
    def paused(self) -> bool:
        """New generate calls wait (pause) until resume."""
        return not self._gate().is_set()

    def _gate(self) -> threading.Event:
        """The admit gate: set while new generate calls are admitted, clear while paused (open on first use)."""
        return self._own("_admit_gate", _open_gate)

    def _wait_admitted(self, cancel: threading.Event | None) -> bool:
        """Block a new generate call while paused: True once the gate is open, False if `cancel` is set first."""
        while not self._gate().wait(ADMIT_POLL_S):
            if cancel is not None and cancel.is_set():
                return False
        return True

    @abc.abstractmethod
    def abort(self) -> None: ...

    def forget_session(self, key: str) -> None:
        """Drop what the engine keeps for a session between its turns (an engine with keeps_sessions)."""

    @property
    @abc.abstractmethod
    def busy(self) -> bool:
        """A generate call is running."""

    def health(self) -> int:
        """Sample one token (temperature 1, as rollouts do) from a one-token prompt and return it; raise if the engine
        cannot: NaN or inf in the distribution (torch.multinomial refuses it; greedy decoding would not notice), or a
        non-finite logprob."""
        (out,) = self.generate([[self.health_token_id()]], HEALTH_PARAMS)
        return checked_health_token(out)

    @abc.abstractmethod
    def health_token_id(self) -> int: ...

    def context_length(self) -> int | None:
        """Most tokens (prompt and generated) the model can attend to; None when the engine cannot tell."""
        return None

    def score(self, sequences: list[list[int]], top_k: int) -> list[ScoredTokens]:
        """The raw (temperature 1) logprob of every token of each sequence given the tokens before it (None for the
        first), and the top_k most likely tokens at each position: prompt logprobs for OpenAI's echo."""
        raise EngineVerbMissing.of(self, "score", "use FARM_ENGINE=torch for prompt logprobs")

    # adapters: an engine that serves them (serves_adapters) overrides all five
    def stage_adapter(self, key: str, config, tensors: dict[str, torch.Tensor]) -> None:
        raise EngineVerbMissing.of(self, "LoRA adapters", "use FARM_ENGINE=torch or sglang for adapters")

    def commit_adapter(self, key: str) -> None:
        raise EngineVerbMissing.of(self, "LoRA adapters", "use FARM_ENGINE=torch or sglang for adapters")

    def discard_adapter(self, key: str) -> None:
        """Nothing was staged on an engine without adapters."""

    def retire_adapter(self, key: str) -> None:
        """Nothing is resident on an engine without adapters."""

    def score_staged_weights(self, version: int, sequences: list[list[int]]) -> list[list[float | None]]:
        """Each sequence's logprobs (None first) under the base weights staged as `version`, which no request sees,
        for a push's probe; WeightsRejected when `version` is not staged."""
        raise EngineVerbMissing.of(
            self, "probes on staged base weights", "push without a probe, or use FARM_ENGINE=torch"
        )

    def score_staged_adapter(self, key: str, sequences: list[list[int]]) -> list[list[float | None]]:
        """Each sequence's logprobs (None first) under the staged adapter `key`, for a push's probe."""
        raise EngineVerbMissing.of(self, "adapter probes", "push without a probe, or use FARM_ENGINE=torch")

    def resident_adapters(self, include_retiring: bool = False) -> dict[str, tuple[int, int]]:
        """key -> (bytes, calls using it) of the resident adapters (include_retiring: and of those retired while a
        call still uses them)."""
        return {}

    def served_base(self) -> tuple[int, str | None]:
        """(the served weight version, its base digest), read together (a commit changes both)."""
        return self.weight_version, self.base_digest

    def pinned(self, adapter: str | None):
        """A context in which resident `adapter` stays resident (AdapterNotResident when it is not); this default
        pins nothing: an engine whose calls pin their own adapter (SGLang) needs no more."""
        return contextlib.nullcontext()

    def served_tensors(self) -> dict[str, torch.Tensor] | None:
        """The served weights by canonical name (read only), which a delta push is rebuilt against; None when the
        engine cannot give them (then a push with a base version is refused: send a full push). The default reads
        `self.model` when the engine keeps an nn.Module there (the torch engine)."""
        from rollout_farm.services.weights.state_dict import canonical_state_dict

        model = getattr(self, "model", None)
        return canonical_state_dict(model) if isinstance(model, torch.nn.Module) else None


HEALTH_PARAMS = SamplingParams(temperature=1.0, max_new_tokens=1, seed=0)


def checked_health_token(out: EngineOutput) -> int:
    """The token a health check sampled, or RuntimeError if it is not one token with a finite logprob."""
    if len(out.token_ids) != 1 or not all(math.isfinite(lp) for lp in out.logprobs):
        raise RuntimeError(f"sampling one token gave {out.token_ids} with logprobs {out.logprobs}")
    return out.token_ids[0]


ENGINES: Registry[type[Engine]] = Registry("engine", base=Engine)
