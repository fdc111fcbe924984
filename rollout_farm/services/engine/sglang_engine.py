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

Weight commits. SGLang's own update (update_weights_from_tensor/_disk/_distributed) takes a writer lock
that waits for every running request and holds new ones back, so in-flight samples finish on the old
weights. This adapter does the same, with its own gate, so that it knows each sample's version:
  finish   wait for in-flight calls, then update (SGLang's default behaviour)
  abort    abort_request(abort_all=True) on in-flight calls, wait for them to return, then update
  partial  the same as finish: every sample keeps one version. A mid-sample switch would need
           pause_generation(mode="retract"), but in 0.5.14 the cache flush after the update then fails on
           the retracted requests and asserts in the scheduler (and without the flush the prefix cache
           keeps old-weight KV); per-token versions (meta_info["weight_versions"]) come only in 0.5.19.
stage_weights_from_path checks the folder's safetensors headers; SGLang reads the files at commit.

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

Unmapped: `seed` becomes SGLang's sampling_seed, which is honoured only by an engine launched with
enable_deterministic_inference (not set here). SGLang's ignore_eos also ignores stop_token_ids, so with
both set the output is cut after the first stop token here. `threads` is unused.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rollout_farm.services.engine.base import ADMIT_POLL_S, ENGINES, Engine, EngineOutput
from rollout_farm.services.protocol import InFlightPolicy, SamplingParams
from rollout_farm.services.weights.checks import (
    WeightsError,
    WeightsRejected,
    check_state_dict,
    non_finite,
    read_header_file,
)
from rollout_farm.services.weights.state_dict import spec_of

if TYPE_CHECKING:
    from rollout_farm.services.settings import ServiceSettings

TORCH_DTYPE_NAMES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
}  # SGLang's distributed update wants torch names


class _LoopThread:
    """Stands in for sglang.Engine.loop. Engine's synchronous methods call loop.run_until_complete, which only
    one thread can enter, while generate requests come from the replica's event loop (and health checks from worker
    threads): so every call runs on one event loop in a background thread instead, where SGLang's tokenizer manager
    (and its zmq sockets) then lives. The replica's loop awaits its futures (agenerate), holding no thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="sglang-loop", daemon=True).start()

    def submit(self, awaitable):
        async def run():
            return await awaitable

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def run_until_complete(self, awaitable):
        return self.submit(awaitable).result()

    def call(self, fn, *args, **kwargs):
        self.loop.call_soon_threadsafe(lambda: fn(*args, **kwargs))


@ENGINES.register("sglang")
class SGLangEngine(Engine):
    keeps_sessions = True  # agenerate takes a cache_key; the radix cache keeps the turns (see the module docstring)

    @classmethod
    def from_settings(cls, model_path: str, settings: ServiceSettings, threads: int | None) -> SGLangEngine:
        """Memory fraction and tensor parallelism from the GPU share (ServiceSettings.sglang_parallelism): engines
        that share a GPU each take their part of it; an engine with several GPUs shards over all of them."""
        fraction, tp = settings.sglang_parallelism
        return cls(model_path, settings.device, settings.dtype, threads, mem_fraction_static=fraction, tp_size=tp)

    def __init__(
        self,
        model_path: str,
        device: str = "cuda",
        dtype: str = "bfloat16",
        threads: int | None = None,
        mem_fraction_static: float | None = None,
        tp_size: int = 1,
    ):
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
        )
        self.ranks_per_engine = tp_size  # each tensor-parallel rank joins the trainer's NCCL group
        self.llm.loop = self._loop = _LoopThread()
        self.weight_version, self.generated_tokens = 0, 0
        self._cv = threading.Condition()  # guards the two below
        self._inflight, self._committing = 0, False
        self._staged: tuple[int, dict[str, torch.Tensor] | str] | None = None
        self._spec: dict[str, tuple[list[int], str]] | None = None

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
    ) -> list[EngineOutput]:
        """Awaited on the replica's event loop, holding no thread: the replica keeps every rollout's calls in flight
        at once and SGLang's scheduler batches them continuously. The request itself runs on the engine's loop
        thread (_LoopThread: SGLang's tokenizer manager lives there, and the synchronous verbs need that loop too);
        this coroutine awaits its future. Cancelling it, or setting `cancel`, aborts the request in SGLang."""
        cancel = cancel or threading.Event()
        while not self._enter():  # paused, or a commit holds new calls back
            if cancel.is_set():
                return self._cancelled_before_start(prompts)
            await asyncio.sleep(ADMIT_POLL_S)
        version, rids = self.weight_version, [f"{cache_key or 'call'}-{uuid.uuid4().hex}" for _ in prompts]
        distinct = [list(p) for p in dict.fromkeys(map(tuple, prompts))]
        prefix_rids = [f"{rids[0]}-prefix-{i}" for i in range(len(distinct))] if len(distinct) < len(prompts) else []
        try:
            done = self._loop.submit(self._group(prompts, distinct, self._sampling(params), rids, prefix_rids))
        except BaseException:
            self._leave()
            raise
        done.add_done_callback(lambda _: self._leave())  # when SGLang has returned, even if the caller has gone
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
        prefixes, results = await result  # done: no wait
        outs = [self._output(r, params, version) for r in results]
        for r in prefixes + results:
            self.stats.prefill(*self._prefill(r))
        self.generated_tokens += sum(len(o.token_ids) for o in outs)
        return outs

    async def _group(
        self, prompts: list[list[int]], distinct: list[list[int]], sampling: dict, rids: list[str], prefix_rids
    ) -> tuple[list[dict], list[dict]]:
        """On the engine's loop. When a prompt comes more than once (a group's n samples), each distinct prompt is
        first prefilled alone (max_new_tokens 0), then all the samples go, and find it in the radix cache: the form
        of SGLang's own n > 1 path (TokenizerManager._handle_batch_request, "Cache the common prefix"), which would
        give the samples new rids that abort_request could not name. Returns (the prefills' results, the samples')."""
        prefixes = []
        if prefix_rids:
            prefixes = await self.llm.async_generate(
                input_ids=distinct, sampling_params={"max_new_tokens": 0}, rid=prefix_rids
            )
        results = await self.llm.async_generate(
            input_ids=prompts, sampling_params=sampling, return_logprob=True, rid=rids
        )
        return prefixes, results

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event | None = None,
        cache_key: str | None = None,
    ) -> list[EngineOutput]:
        """agenerate, from a thread (the health check)."""
        return self._loop.run_until_complete(self.agenerate(prompts, params, cancel, cache_key))

    def _enter(self) -> bool:
        """Count a call in flight, unless new calls are held back now (paused, or a commit)."""
        with self._cv:
            if self.paused or self._committing:
                return False
            self._inflight += 1
            self.stats.busy(True)
            return True

    def _leave(self) -> None:
        with self._cv:
            self._inflight -= 1
            self.stats.busy(self._inflight > 0)
            self._cv.notify_all()

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

    # weights ---------------------------------------------------------------
    def weight_spec(self) -> dict[str, tuple[list[int], str]]:
        if self._spec is None:  # from the config on the meta device: SGLang holds the only real copy
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path), dtype=self.dtype)
            self._spec = spec_of(dict(model.named_parameters()))
        return self._spec

    def _check(self, got: dict[str, tuple[list[int], str]], version: int) -> None:
        problems = check_state_dict(self.weight_spec(), got) + self._version_problems(version)
        if problems:
            raise WeightsRejected("; ".join(problems))

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if problems := non_finite(state_dict):
            raise WeightsRejected("; ".join(problems))
        self._check(spec_of(state_dict), version)
        self._staged = (version, state_dict)

    def stage_weights_from_path(self, path: str, version: int) -> None:
        """Check the folder's safetensors headers; SGLang reads the files itself at the commit."""
        got = {}
        try:
            for f in sorted(Path(path).glob("*.safetensors")):
                got.update(read_header_file(f))
        except WeightsError as e:
            raise WeightsRejected(str(e)) from None
        self._check(got, version)
        self._staged = (version, str(path))

    def _commit_staged(self, version: int, policy: InFlightPolicy | None) -> None:
        """Update SGLang's weights from the staged tensors or folder, alone: in-flight calls finish (or are aborted)
        first and new ones wait ("partial" is "finish" here)."""
        staged = self._staged[1]
        with self._exclusive(abort=policy == "abort"):
            if isinstance(staged, str):
                ok, message = self.llm.update_weights_from_disk(staged)[:2]
            else:
                ok, message = self.llm.update_weights_from_tensor(list(staged.items()))
            if not ok:
                raise WeightsRejected(message)
            self.weight_version, self._staged = version, None

    @contextmanager
    def _exclusive(self, abort: bool = False):
        """Hold new generate calls back and wait for the in-flight ones (aborting them first if asked)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._committing)
            self._committing = True
            while self._inflight:
                if abort:
                    self.abort()
                self._cv.wait(0.05)
        try:
            yield
        finally:
            with self._cv:
                self._committing = False
                self._cv.notify_all()

    # NCCL transport: the trainer is rank 0 of the group and broadcasts each tensor ----------------
    # ranks_per_engine (set in __init__): tp_size GPUs per engine; replica i's ranks start at rank_offset + i * tp_size

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        ok, message = self.llm.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        if not ok:
            raise RuntimeError(message)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        group_name: str = "weight_update_group",
    ) -> None:
        with self._exclusive():
            ok, message = self.llm.update_weights_from_distributed(
                names, [TORCH_DTYPE_NAMES.get(d, d) for d in dtypes], shapes, group_name
            )
            if not ok:
                raise WeightsRejected(message)
            self.weight_version = version
