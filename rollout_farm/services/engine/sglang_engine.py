"""SGLang's offline engine (`sglang.Engine`) behind the engine interface, for GPUs (the `sglang` extra).

Written against sglang 0.5.14, which the `sglang` extra pins (the newest under verl's transformers<5.11; 0.5.15
and later pin newer transformers), and read against 0.5.23; it needs >= 0.5.6. tests/unit/test_sglang_contract.py
checks this module's calls against the pinned version's source, without a GPU.

Logprobs: generate asks for return_logprob=True and reads meta_info["output_token_logprobs"], a list of
(logprob, token_id, text). By default SGLang returns them after temperature (log of the tempered
softmax, before top-p/k). With SGLANG_RETURN_ORIGINAL_LOGPROB=1, which this module sets for the scheduler
process that the engine spawns, they are log_softmax of the raw logits: temperature 1, no top-p/k.
Greedy batches (temperature 0) always return raw logprobs. So SGLang reports one kind only: its outputs carry no
`sampling_logprobs` (the logprobs under the tempered, truncated distribution sampled), and a Sample's stay None
(the importance_resampling sampler's 'policy_ratio' target, which needs them, is a 422 on this engine).

Weight commits: sglang_weights.py (its docstring says how a commit keeps each sample on one version).

Sessions (keeps_sessions). SGLang has no per-session state to keep: its radix cache holds every prompt's KV by
prefix (evicted least recently used), and this adapter launches it with the cache on (disable_radix_cache=False,
the default, said explicitly so that the contract test checks the option still exists). The service routes a session
to one replica while it is healthy (rollout_farm/services/replica/session_routes.py), so a turn's prompt, the session's
tokens so far, finds its earlier turns cached there. A session's requests carry its id in their rid (`<session>-<n>`),
and meta_info's prompt_tokens and cached_tokens feed the prefill counters (stats.prefill; on SGLang any prefix hit
counts, a group's shared prompt too). forget_session has nothing to drop.

Groups. SGLang's radix cache shares a prompt only once a request holding it has been prefilled: n copies sent
together are each prefilled. So a call that holds a prompt more than once (a GRPO group) first prefills each distinct
prompt alone, then sends the samples (`_group`), as SGLang's own n > 1 path does.

Concurrency: the replica awaits agenerate, which awaits async_generate's future without holding a thread, so a
replica keeps every rollout's calls in flight at once and SGLang's scheduler batches them continuously.

Adapters (serves_adapters; sglang_adapters.py holds the checks, the folder and the key table). An engine started with
a LoRA max rank (FARM_SGLANG_MAX_LORA_RANK) launches SGLang with enable_lora, max_lora_rank, lora_target_modules and
max_loras_per_batch; without one, adapters are refused (501). stage_adapter checks the adapter (a 422 naming each
misfit: SGLang itself checks little and would fail in its scheduler), writes it as a peft folder in a temporary
directory and loads it (load_lora_adapter) under the farm key, `name@vN`, as SGLang's lora_name; commit_adapter lets
calls name it; agenerate(adapter=key) pins the key until SGLang has returned and passes lora_path=key on each of its
requests (the group's prefill too: SGLang keys its radix cache by adapter), AdapterNotResident for a key that is not
resident. discard_adapter and retire_adapter stop routing to the key at once, and unload it (async_unload_lora_adapter,
on the engine's loop: the caller does not wait) when its last call has ended, then delete the folder. Keys are not
reused, but a key staged again while it retires is taken back without a reload, and one staged while it unloads waits
for the unload. base_digest hashes what SGLang was told to load (sglang_digest.py): the model folder at the start,
each base push's tensors or folder; None after an NCCL push, which passes no bytes through here.

Unmapped: `seed` becomes SGLang's sampling_seed, which is honoured only by an engine launched with
enable_deterministic_inference (not set here). SGLang's ignore_eos also ignores stop_token_ids, so with
both set the output is cut after the first stop token here. `threads` is unused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer

from rollout_farm.services.engine.base import (
    ADMIT_POLL_S,
    ENGINES,
    AdapterNotResident,
    Engine,
    EngineOutput,
    ScoredTokens,
)
from rollout_farm.services.engine.loop_thread import LoopThread
from rollout_farm.services.engine.sglang_adapter_verbs import SGLangAdapterVerbs
from rollout_farm.services.engine.sglang_adapters import (
    DEFAULT_MAX_LORAS_PER_BATCH,
    DEFAULT_TARGET_MODULES,
    AdapterTable,
    LoraLaunch,
)
from rollout_farm.services.engine.sglang_digest import folder_digest
from rollout_farm.services.engine.sglang_weights import SGLangWeights
from rollout_farm.services.protocol import SamplingParams

if TYPE_CHECKING:
    from rollout_farm.services.config.settings import ServiceSettings

log = logging.getLogger("farm.service")
# SGLang's errors for a request naming an adapter it does not hold (tokenizer_manager.py, lora/lora_registry.py)
NOT_LOADED = ("Got LoRA adapter that has never been loaded", "requested LoRA adapters are not loaded")


class _LoopThread(LoopThread):
    """Stands in for sglang.Engine.loop. Engine's synchronous methods call loop.run_until_complete, which only
    one thread can enter, while generate requests come from the replica's event loop (and health checks from worker
    threads): so every call runs on one event loop in a background thread instead (loop_thread.py), where SGLang's
    tokenizer manager (and its zmq sockets) then lives. The replica's loop awaits its futures (agenerate), holding no
    thread."""

    def __init__(self):
        super().__init__("sglang-loop")


@ENGINES.register("sglang")
class SGLangEngine(SGLangAdapterVerbs, SGLangWeights, Engine):
    keeps_sessions = True  # agenerate takes a cache_key; the radix cache keeps the turns (see the module docstring)
    serves_adapters = True  # LoRA adapters, when started with a max LoRA rank (see the module docstring)

    @classmethod
    def from_settings(cls, model_path: str, settings: ServiceSettings, threads: int | None) -> SGLangEngine:
        """Memory fraction and tensor parallelism from the GPU share (ServiceSettings.sglang_parallelism): engines
        that share a GPU each take their part of it; an engine with several GPUs shards over all of them. LoRA from
        FARM_SGLANG_MAX_LORA_RANK (unset: none), FARM_SGLANG_LORA_TARGET_MODULES and FARM_SGLANG_MAX_LORAS_PER_BATCH."""
        fraction, tp = settings.sglang_parallelism
        lora = {}
        max_rank = getattr(settings, "sglang_max_lora_rank", None)
        if max_rank is not None:
            lora = {
                "max_lora_rank": max_rank,
                "lora_target_modules": list(
                    getattr(settings, "sglang_lora_target_modules", None) or DEFAULT_TARGET_MODULES
                ),
                "max_loras_per_batch": getattr(settings, "sglang_max_loras_per_batch", DEFAULT_MAX_LORAS_PER_BATCH),
            }
        return cls(
            model_path, settings.device, settings.dtype, threads, mem_fraction_static=fraction, tp_size=tp, **lora
        )

    def __init__(
        self,
        model_path: str,
        device: str = "cuda",
        dtype: str = "bfloat16",
        threads: int | None = None,
        mem_fraction_static: float | None = None,
        tp_size: int = 1,
        max_lora_rank: int | None = None,
        lora_target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
        max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH,
    ):
        """max_lora_rank None: SGLang starts without LoRA (no adapter buffers) and adapters are refused."""
        lora = LoraLaunch(max_lora_rank, tuple(lora_target_modules), max_loras_per_batch)
        if problems := lora.problems():
            raise ValueError("; ".join(problems))
        try:
            import sglang
        except ImportError as e:
            raise RuntimeError("the sglang engine needs the GPU extra: pip install 'rollout-farm[sglang]'") from e
        from packaging.version import Version

        if Version(sglang.__version__) < Version("0.5.6"):  # older ones return logprobs after temperature
            raise RuntimeError(f"the sglang engine needs sglang>=0.5.6, found {sglang.__version__}")
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"  # read by the spawned scheduler: logprobs before temperature
        self.model_path, self.dtype = model_path, getattr(torch, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.llm = sglang.Engine(
            model_path=model_path,
            device=device,
            dtype=dtype,
            disable_radix_cache=False,
            mem_fraction_static=mem_fraction_static,  # None: SGLang's own, for an engine alone on its GPUs
            tp_size=tp_size,
            enable_lora=lora.enabled,  # adapter buffers (sized by the three below) are allocated at the start
            max_lora_rank=lora.max_rank,
            lora_target_modules=list(lora.target_modules) if lora.enabled else None,
            max_loras_per_batch=lora.max_loras_per_batch,  # the base model counts as one
        )  # no max_loaded_loras: SGLang would unload adapters by itself past it
        self.ranks_per_engine = tp_size  # each tensor-parallel rank joins the trainer's NCCL group
        self._attach(self.llm, lora)
        self._served_digest(0, folder_digest(model_path, self._names(), self.dtype))

    def _attach(self, llm, lora: LoraLaunch) -> None:
        """Serve through `llm` (the sglang.Engine; the unit tests pass a stand-in): the state every verb reads."""
        self.llm = llm
        self.llm.loop = self._loop = _LoopThread()
        self.weight_version, self.generated_tokens = 0, 0
        self._cv = threading.Condition()  # guards the two below
        self._inflight, self._committing = 0, False
        self._staged: tuple[int, dict[str, torch.Tensor] | str] | None = None
        self._lora, self._adapters = lora, AdapterTable()
        self._staging = threading.Lock()  # one stage_adapter at a time: a key is loaded once
        self._adapter_root: Path | None = None  # the staged folders, made on first use, removed with the engine
        self._linear_shapes: dict[str, tuple[int, int]] | None | bool = False  # False: not read yet
        self._attach_weights()

    # lifecycle -------------------------------------------------------------
    def abort(self) -> None:
        self._loop.call(self.llm.tokenizer_manager.abort_request, abort_all=True)

    @property
    def busy(self) -> bool:
        return self._inflight > 0

    def health_token_id(self) -> int:
        t = self.tokenizer
        return next(i for i in (t.bos_token_id, t.pad_token_id, t.eos_token_id, 0) if i is not None)

    # generation ------------------------------------------------------------
    async def agenerate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event | None = None,
        cache_key: str | None = None,
        adapter: str | None = None,
    ) -> list[EngineOutput]:
        """Awaited on the replica's event loop, holding no thread: the replica keeps every rollout's calls in flight
        at once and SGLang's scheduler batches them continuously. The request itself runs on the engine's loop
        thread (_LoopThread: SGLang's tokenizer manager lives there, and the synchronous verbs need that loop too);
        this coroutine awaits its future. Cancelling it, or setting `cancel`, aborts the request in SGLang.
        `adapter`: a resident adapter's key, pinned until SGLang has returned (AdapterNotResident when it is not
        resident)."""
        cancel = cancel or threading.Event()
        while not self._enter(adapter):  # paused, or a commit holds new calls back
            if cancel.is_set():
                return self._cancelled_before_start(prompts)
            await asyncio.sleep(ADMIT_POLL_S)
        version, rids = self.weight_version, [f"{cache_key or 'call'}-{uuid.uuid4().hex}" for _ in prompts]
        distinct = [list(p) for p in dict.fromkeys(map(tuple, prompts))]
        prefix_rids = [f"{rids[0]}-prefix-{i}" for i in range(len(distinct))] if len(distinct) < len(prompts) else []
        try:
            done = self._loop.submit(
                self._group(prompts, distinct, self._sampling(params), rids, prefix_rids, adapter=adapter)
            )
        except BaseException:
            self._leave(adapter)
            raise
        done.add_done_callback(lambda _: self._leave(adapter))  # when SGLang has returned, even if the caller has gone
        result = asyncio.wrap_future(done)
        result.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning in the log
        try:
            while not result.done():
                await asyncio.wait([result], timeout=0.05)  # never cancels `result`
                if cancel.is_set():  # again at each tick: a request still being tokenized ignores its abort
                    self._abort_requests(prefix_rids + rids)
        except asyncio.CancelledError:
            self._abort_requests(prefix_rids + rids)
            raise
        try:
            prefixes, results = await result  # done: no wait
        except ValueError as e:  # a backstop: the key was checked at _enter, and is unloaded only once unpinned
            if adapter is not None and any(m in str(e) for m in NOT_LOADED):
                raise AdapterNotResident(adapter) from e
            raise
        outs = [self._output(r, params, version) for r in results]
        for r in prefixes + results:
            self.stats.prefill(*self._prefill(r))
        self.generated_tokens += sum(len(o.token_ids) for o in outs)
        return outs

    async def _group(
        self,
        prompts: list[list[int]],
        distinct: list[list[int]],
        sampling: dict,
        rids: list[str],
        prefix_rids,
        adapter: str | None = None,
    ) -> tuple[list[dict], list[dict]]:
        """On the engine's loop. When a prompt comes more than once (a group's n samples), each distinct prompt is
        first prefilled alone (max_new_tokens 0), then all the samples go, and find it in the radix cache: the form
        of SGLang's own n > 1 path (TokenizerManager._handle_batch_request, "Cache the common prefix"), which would
        give the samples new rids that abort_request could not name. Both requests name the same adapter (lora_path,
        SGLang's lora_name; None: the base model): SGLang keys the radix cache by adapter, so a prefill under another
        one would warm nothing the samples find. Returns (the prefills' results, the samples')."""
        prefixes = []
        if prefix_rids:
            prefixes = await self.llm.async_generate(
                input_ids=distinct, sampling_params={"max_new_tokens": 0}, rid=prefix_rids, lora_path=adapter
            )
        results = await self.llm.async_generate(
            input_ids=prompts, sampling_params=sampling, return_logprob=True, rid=rids, lora_path=adapter
        )
        return prefixes, results

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event | None = None,
        cache_key: str | None = None,
        adapter: str | None = None,
    ) -> list[EngineOutput]:
        """agenerate, from a thread (the health check)."""
        return self._loop.run_until_complete(self.agenerate(prompts, params, cancel, cache_key, adapter))

    def _enter(self, adapter: str | None = None) -> bool:
        """Count a call in flight, and pin its adapter, unless new calls are held back now (paused, or a commit);
        AdapterNotResident when the adapter is not resident (checked while held back too)."""
        with self._cv:
            if self.paused or self._committing:
                if adapter is not None and adapter not in self._adapters.snapshot():
                    raise AdapterNotResident(adapter)
                return False
            if adapter is not None:
                try:
                    self._adapters.pin(adapter)
                except KeyError:
                    raise AdapterNotResident(adapter) from None
            self._inflight += 1
            self.stats.busy(True)
            return True

    def _leave(self, adapter: str | None = None) -> None:
        with self._cv:
            self._inflight -= 1
            self.stats.busy(self._inflight > 0)
            self._cv.notify_all()
        if adapter is not None and (held := self._adapters.unpin(adapter)) is not None:
            self._unload(adapter, held)  # retired while this call used it: it was the last

    def _abort_requests(self, rids: list[str]) -> None:
        for rid in rids:
            self._loop.call(self.llm.tokenizer_manager.abort_request, rid)

    @staticmethod
    def _sampling(params: SamplingParams) -> dict:
        """SGLang's sampling params for ours."""
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_new_tokens": params.max_new_tokens,
            "stop_token_ids": params.stop_token_ids,
            "stop": params.stop,
            "ignore_eos": params.ignore_eos,
            "sampling_seed": params.seed,
        }
        if params.regex is not None:  # SGLang's grammar backend (xgrammar/outlines) constrains the whole output
            sampling["regex"] = params.regex
        return sampling

    @staticmethod
    def _prefill(result: dict) -> tuple[int, int]:
        """(prompt tokens fed through the model, prompt tokens the radix cache already held)."""
        meta = result["meta_info"]
        return meta["prompt_tokens"] - meta["cached_tokens"], meta["cached_tokens"]

    @staticmethod
    def _output(result: dict, p: SamplingParams, version: int) -> EngineOutput:
        meta = result["meta_info"]
        ids, lps, reason = (
            list(result["output_ids"]),
            [lp for lp, _, _ in meta["output_token_logprobs"]],
            meta["finish_reason"]["type"],
        )
        if p.ignore_eos and p.stop_token_ids:
            cut = next((i + 1 for i, t in enumerate(ids) if t in p.stop_token_ids), None)
            if cut is not None:
                ids, lps, reason = ids[:cut], lps[:cut], "stop"
        return EngineOutput(ids, lps, reason, version, [version] * len(ids))

    def score(self, sequences: list[list[int]], top_k: int, adapter: str | None = None) -> list[ScoredTokens]:
        return super().score(sequences, top_k)  # EngineVerbMissing (a 501), with an adapter or without
