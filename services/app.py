"""The rollout service: a FastAPI ingress deployment in front of engine replicas, on Ray Serve.

  HTTP ─► Ingress (validation, auth, metrics) ─► EngineServer × replicas (tokenize, generate, reward)
                     └─ weight push: header check, then broadcast to every replica ─┘
                                                  WeightStore (deployment actor): the committed
                                                  version, loaded by a replica before it serves
"""

import asyncio
import contextvars
import hashlib
import hmac
import importlib
import json
import logging
import os
import pathlib
import random
import statistics
import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

import ray
from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from ray import serve
from ray.serve.config import DeploymentActorConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from services import metrics, openai_compat
from services import protocol as P
from services.engine.base import WeightsRejected
from services import rewards, samplers  # registries through their modules: Serve pickles the ingress class by value, with copies of its globals
from services.queue import NoSource, SourceExists, TrajectoryQueue
from services.samplers import SamplerState, make_sampler
from services.settings import ServiceSettings
from services.weights import WeightsError, check_state_dict, check_upload, read_header_file

log = logging.getLogger("farm.service")


@ray.remote(num_cpus=0)
class WeightStore:
    """The committed weight version and where its weights are, so a new replica can catch up.

    The source is ("bytes", [ref]) for an HTTP push (ray.put here, so the store owns a copy that
    outlives the sender) or ("path", folder) for a push from shared storage.
    """

    def __init__(self):
        self.version, self.source = 0, None

    def commit(self, version: int, source: tuple) -> None:
        if version >= self.version:  # equal: a push retried after its commit failed
            if source[0] == "bytes":
                source = ("bytes", [ray.put(ray.get(source[1][0]))])
            self.version, self.source = version, source

    def current(self) -> tuple[int, tuple | None]:
        return self.version, self.source


class VersionNotReached(Exception):
    """A rollout asked for a weight version that no push has committed in time."""


class RolloutCancelled(Exception):
    """The rollout was cancelled (DELETE /v1/rollouts/{request_id}, or its first caller went away)."""


CONTROL_SLOTS = 4  # Serve request slots per engine replica that rollouts leave free: pushes, control and scrapes get through a full replica


class ReplicaFull(Exception):
    """A replica already runs FARM_ENGINE_MAX_ONGOING_REQUESTS rollouts and has CONTROL_SLOTS // 2 waiting."""


def load_plugins(settings: ServiceSettings) -> None:
    """Import the modules named in FARM_PLUGINS so that their registrations run."""
    for module in settings.plugins:
        importlib.import_module(module)


def read_safetensors_folder(path: str) -> dict:
    """Every tensor of the *.safetensors files in a folder (sharded checkpoints included)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


class EngineServer:
    """One engine replica: tokenizes, generates, decodes and scores."""

    async def __init__(self, settings: ServiceSettings):
        from services.engine import make_engine
        from services.models import resolve_model

        load_plugins(settings)
        self.settings = settings
        threads = settings.engine_threads or max(1, (os.cpu_count() or 1) // settings.replicas)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="engine")  # torch runs fastest when one thread makes every model call
        self.engine = await self._on_engine_thread(make_engine, settings.engine, str(resolve_model(settings.model)), settings.device, settings.dtype,
                                                   threads, settings.bench_token_latency_s)
        self.tok = self.engine.tokenizer
        self.catch_up_lock = asyncio.Lock()
        self.rollout_slots, self.rollouts_waiting = asyncio.Semaphore(settings.engine_max_ongoing_requests), 0
        self.pending_version = 0  # a commit in progress on this replica
        await self.catch_up(0)  # before Serve routes any traffic here

    async def catch_up(self, min_version: int) -> None:
        """Load the committed version from the store if it is newer; wait up to FARM_MIN_VERSION_WAIT_S for min_version."""
        deadline = time.monotonic() + self.settings.min_version_wait_s
        while True:
            async with self.catch_up_lock:
                store = serve.get_deployment_actor("weights")  # looked up each time: Serve may recreate it
                version, source = await store.current.remote()
                if version > self.engine.weight_version:
                    await self.commit(version, None, source)
                    log.info(json.dumps({"event": "caught_up", "version": version}))
            if self.engine.weight_version >= min_version:
                return
            if time.monotonic() > deadline:
                raise VersionNotReached(f"weight version {min_version} was not committed within FARM_MIN_VERSION_WAIT_S={self.settings.min_version_wait_s}; "
                                        f"this replica serves {self.engine.weight_version}")
            await asyncio.sleep(0.05)

    async def rollout(self, prompts: list[P.Prompt], n: int, params: P.SamplingParams, reward: str | None, min_version: int = 0,
                      meta: dict | None = None, sampler: P.SamplerSpec | None = None) -> list[P.Group]:
        """The groups of these prompts, n samples each, in one engine batch. Serve gives this replica
        FARM_ENGINE_MAX_ONGOING_REQUESTS + CONTROL_SLOTS calls at once; rollouts take at most all but two of them."""
        if self.rollout_slots.locked() and self.rollouts_waiting >= CONTROL_SLOTS - 2:
            raise ReplicaFull()
        self.rollouts_waiting += 1
        try:
            await self.rollout_slots.acquire()
        finally:
            self.rollouts_waiting -= 1
        try:
            return await self._rollout(prompts, n, params, reward, min_version, meta or {"sampler": "plain"}, sampler or P.SamplerSpec())
        finally:
            self.rollout_slots.release()

    async def _rollout(self, prompts: list[P.Prompt], n: int, params: P.SamplingParams, reward: str | None, min_version: int, meta: dict,
                       spec: P.SamplerSpec) -> list[P.Group]:
        if self.engine.weight_version < min_version:
            await self.catch_up(min_version)
        sampler, rng = make_sampler(spec, self.settings.plugins), random.Random(params.seed)
        m, step = sampler.candidates(n), max(1, sampler.round_size(n))
        ids = [p.token_ids if p.token_ids is not None else self.tok(p.text, add_special_tokens=False).input_ids for p in prompts]
        cands: list[list[P.Sample]] = [[] for _ in prompts]
        live = list(range(len(prompts)))  # groups still generating: each round adds `step` candidates to each
        for r in range(-(-m // step)):
            k = min(step, m - r * step)
            flat = [ids[i] for i in live for _ in range(k)]
            outs = await self._generate_rerun(flat, _round_params(params, r))
            for j, i in enumerate(live):
                cands[i] += [self._sample(o, prompts[i], reward, meta, sampler.wants_log_ratio) for o in outs[j * k:(j + 1) * k]]
            live = [i for i in live if not sampler.enough(cands[i], n)]
            if not live:
                break
        groups = []
        for i, samples in enumerate(cands):
            kept = sampler.select(samples, n, rng)
            scores = [s.reward for s in kept]
            std = statistics.pstdev(scores) if scores else 0.0
            groups.append(P.Group(prompt_token_ids=ids[i], samples=kept, reward_mean=statistics.fmean(scores) if scores else 0.0, reward_std=std,
                                  zero_variance=std < 1e-6, candidates=len(samples) if m != n else None, rejected=sampler.rejected(samples),
                                  generated_tokens=sum(len(s.token_ids) for s in samples)))
        return groups

    async def _generate_rerun(self, flat: list[list[int]], params: P.SamplingParams) -> list:
        """engine.generate, then the samples cut by an "abort" weight commit run again on the new weights."""
        outs = await self._generate(flat, params)
        for _ in range(3):
            served = await self._settled() if any(o.finish_reason == "abort" for o in outs) else self.engine.weight_version
            redo = [i for i, o in enumerate(outs) if o.finish_reason == "abort" and o.weight_version < served]
            if not redo:
                break
            for i, o in zip(redo, await self._generate([flat[i] for i in redo], params)):
                outs[i] = o
        return outs

    def _sample(self, o, prompt: P.Prompt, reward: str | None, meta: dict, log_ratio: bool) -> P.Sample:
        """An engine output, decoded and scored. One bad score marks its sample ("error"), not the batch."""
        text = self.tok.decode(o.token_ids, skip_special_tokens=True)
        reason, r = o.finish_reason, 0.0
        try:
            r = float(rewards.REWARDS.get(reward)(text, prompt.ground_truth)) if reward else 0.0
        except Exception as e:
            log.warning(json.dumps({"event": "reward_failed", "reward": reward, "error": repr(e)}))
            reason = "error"
        if log_ratio and o.sampling_logprobs is not None:  # log p/q of the sample: raw policy over the distribution sampled
            meta = {**meta, "log_ratio": sum(o.logprobs) - sum(o.sampling_logprobs)}
        mixed = o.token_versions if len(set(o.token_versions)) > 1 else None
        return P.Sample(token_ids=o.token_ids, logprobs=o.logprobs, text=text, finish_reason=reason, reward=r,
                        weight_version=o.weight_version, token_weight_versions=mixed, sampler_meta=meta)

    def _on_engine_thread(self, fn, *args):
        return asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _generate(self, prompts: list[list[int]], params: P.SamplingParams) -> list:
        """engine.generate on the engine thread; if this call is cancelled, so is the engine work."""
        cancel = threading.Event()
        try:
            return await asyncio.shield(self._on_engine_thread(self.engine.generate, prompts, params, cancel))
        except asyncio.CancelledError:
            cancel.set()
            raise

    async def stage(self, source: tuple, version: int) -> int:
        """Phase one of a push: check and hold the weights next to the served ones."""
        if source[0] == "path" and hasattr(self.engine, "stage_from_path"):  # SGLang reads the folder itself
            return await asyncio.to_thread(self.engine.stage_from_path, source[1], version) or version
        tensors = await asyncio.to_thread(self._read, source)
        await asyncio.to_thread(self.engine.stage_weights, tensors, version)
        return version

    async def commit(self, version: int, policy: str | None, source: tuple) -> int:
        """Phase two: serve the staged version (the ingress has recorded it in the store). A replica that
        joined after phase one stages from `source` first. A catch-up (policy None) keeps a push's policy."""
        if version <= self.engine.weight_version:
            return self.engine.weight_version
        self.pending_version = max(self.pending_version, version)
        try:
            try:
                await asyncio.to_thread(self.engine.commit_weights, version, policy)
            except WeightsRejected:  # nothing staged here: this replica started after phase one
                await self.stage(source, version)
                await asyncio.to_thread(self.engine.commit_weights, version, policy)
        finally:
            self.pending_version = self.engine.weight_version  # also when the commit failed: nothing is pending then
        return self.engine.weight_version

    async def record(self, version: int, source: tuple) -> None:
        """Make `version` the one a starting replica loads (the store belongs to this deployment)."""
        await serve.get_deployment_actor("weights").commit.remote(version, source)

    async def _settled(self) -> int:
        """The served version once no commit is pending (an "abort" commit cuts samples before it lands)."""
        while self.pending_version > self.engine.weight_version:
            await asyncio.sleep(0.01)
        return self.engine.weight_version

    def discard(self, version: int) -> None:
        self.engine.discard_weights(version)

    @staticmethod
    def _read(source: tuple) -> dict:
        from safetensors.torch import load

        kind, where = source
        return load(ray.get(where[0])) if kind == "bytes" else read_safetensors_folder(where)

    async def init_weights_update_group(self, group: P.DistributedGroup, replica_ids: list[str]) -> int:
        """Join the trainer's group at rank rank_offset + (this replica's place among replica_ids) * ranks per engine.
        Blocks (off the event loop) until the trainer and every replica have joined."""
        engine = self._distributed()
        rank = group.rank_offset + replica_ids.index(serve.get_replica_context().replica_id.unique_id) * engine.ranks_per_engine
        await asyncio.to_thread(engine.init_weights_update_group, group.master_address, group.master_port, rank, group.world_size, group.group_name, group.backend)
        return rank

    async def update_weights_from_distributed(self, update: P.DistributedUpdate, replica_ids: list[str]) -> int:
        await asyncio.to_thread(self._distributed().update_weights_from_distributed, update.names, update.dtypes, update.shapes, update.version, update.group_name)
        return self.engine.weight_version

    def _distributed(self):
        if not hasattr(self.engine, "update_weights_from_distributed"):
            raise NotImplementedError(f"the {self.settings.engine!r} engine has no NCCL weight transport: run FARM_ENGINE=sglang on GPUs")
        return self.engine

    def weight_spec(self) -> dict:
        return self.engine.weight_spec()

    def render_chat(self, messages: list[dict]) -> str | None:
        """Messages through the model's chat template, ready for generation; None without a template."""
        if not self.tok.chat_template:
            return None
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def token_pieces(self, samples: list[list[int]]) -> list[list[str]]:
        """The text each token adds, so that the pieces of a sample join to its text. Decoded in a short
        window of context (as vLLM does): a token that ends inside a multi-byte character adds "" and the
        token that completes it adds the character; a lone token would lose a SentencePiece leading space."""
        out = []
        for ids in samples:
            pieces, prefix, read = [], 0, 0
            for i in range(len(ids)):
                before = self.tok.decode(ids[prefix:read], skip_special_tokens=True)
                text = self.tok.decode(ids[prefix:i + 1], skip_special_tokens=True)
                if len(text) > len(before) and (not text.endswith("\ufffd") or i + 1 == len(ids)):
                    pieces.append(text[len(before):])
                    prefix, read = read, i + 1
                else:
                    pieces.append("")
            out.append(pieces)
        return out

    def vocab_size(self) -> int:
        return max(len(self.tok), getattr(getattr(self.engine, "model", None), "config", self.tok).vocab_size)

    def weight_version(self) -> tuple[str, int]:
        """(this replica's id, the version it serves)."""
        return serve.get_replica_context().replica_id.unique_id, self.engine.weight_version

    async def health(self) -> P.Health:
        if self.engine.paused:
            return P.Health(status="paused", weight_version=self.engine.weight_version)
        token = await self._on_engine_thread(self.engine.health)
        return P.Health(status="ok", weight_version=self.engine.weight_version, generated_token_id=token)

    def control(self, action: str) -> P.ReplicaState:
        """Pause or resume admitting generate calls, or abort the one in flight."""
        {"pause": self.engine.pause, "resume": self.engine.resume, "abort": self.engine.abort, "none": lambda: None}[action]()
        return P.ReplicaState(replica=serve.get_replica_context().replica_id.unique_id, weight_version=self.engine.weight_version, paused=self.engine.paused,
                              busy=self.engine.busy, generated_tokens=self.engine.generated_tokens)


api = FastAPI(title="rollout-farm", version=P.API_VERSION, description="Rollout service for LLM reinforcement learning.")


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _invalid(_fields(exc.errors()))


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail))


@api.exception_handler(Exception)
async def _crash(request: Request, exc: Exception) -> JSONResponse:
    log.error(json.dumps({"event": "unhandled_error", "path": request.url.path, "error": repr(exc)}))
    return _error(500, f"internal error: {type(exc).__name__}; see the service log")


def _invalid(detail: list[dict]) -> JSONResponse:
    """422 naming each bad field."""
    return _error(422, "invalid request: fix the named fields", detail)


def _error(status: int, error: str, detail: list[dict] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=P.ErrorResponse(error=error, detail=detail or []).model_dump())


MAX_REQUEST_BYTES = 32 << 20  # JSON bodies; weight pushes and prompt uploads have their own FARM_ limits


class BodyLimit:
    """413 for a body over MAX_REQUEST_BYTES, declared or (chunked) counted as it arrives."""

    def __init__(self, app, limit: int = MAX_REQUEST_BYTES):
        self.app, self.limit = app, limit

    @staticmethod
    def own_limit(path: str) -> bool:
        """The streamed uploads, which count their bytes against their own FARM_ limits."""
        return path == "/v1/weights" or (path.startswith("/v1/queue/sources/") and path.endswith("/prompts"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.own_limit(scope["path"]):
            return await self.app(scope, receive, send)
        too_large = HTTPException(413, f"request body over {self.limit} bytes: send fewer prompts per request")
        if int(dict(scope["headers"]).get(b"content-length", 0)) > self.limit:
            return await _error(413, too_large.detail)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise too_large
            return message

        await self.app(scope, counted, send)


api.add_middleware(BodyLimit)


@api.middleware("http")
async def _metrics(request: Request, call_next):
    start = time.perf_counter()
    response = await call_next(request)
    path = request.scope.get("route").path if request.scope.get("route") else "other"
    metrics.LATENCY.labels(path).observe(time.perf_counter() - start)
    metrics.REQUESTS.labels(path, str(response.status_code)).inc()
    return response


def _split(items: list, k: int) -> list[list]:
    """items in at most k contiguous, non-empty chunks of near-equal size."""
    k = max(1, min(k, len(items)))
    q, r = divmod(len(items), k)
    bounds = [i * q + min(i, r) for i in range(k + 1)]
    return [items[bounds[i]:bounds[i + 1]] for i in range(k)]


def _chunk_params(params: P.SamplingParams, i: int) -> P.SamplingParams:
    """Params for chunk i: its own seed, so that chunks on different replicas do not repeat each other's draws."""
    return params if params.seed is None else params.model_copy(update={"seed": (params.seed + i) % 2**63})


def _round_params(params: P.SamplingParams, r: int) -> P.SamplingParams:
    """Params for a sampler's round r: a seed of its own, far from the chunks' (seed + chunk index)."""
    return _chunk_params(params, r * 1_000_003)


def _fields(errors: list[dict], *prefix: str) -> list[dict]:
    """pydantic errors as 422 detail: the dotted field and the message."""
    return [{"field": ".".join([*prefix, *(str(x) for x in e["loc"] if x != "body")]), "message": e["msg"]} for e in errors]


def _jsonl_prompts(body: bytes) -> tuple[list[P.Prompt], list[dict]]:
    """Prompts from JSONL, one per non-empty line, and the errors (fields named 'line N....')."""
    prompts, errors = [], []
    for i, line in enumerate(body.decode("utf-8", "replace").splitlines(), 1):
        if line.strip():
            try:
                prompts.append(P.Prompt.model_validate_json(line))
            except ValidationError as e:
                errors += _fields(e.errors(), f"line {i}")
    if not prompts and not errors:
        errors = [{"field": "body", "message": "no prompts: send one JSON Prompt per line"}]
    return prompts, errors


class Job:
    """One rollout request at the ingress: its groups in the order they finished, and the task making them."""

    def __init__(self, fingerprint: str, size: int):
        self.fingerprint, self.size = fingerprint, size
        self.groups: dict[int, P.Group] = {}  # prompt index -> group, in finishing order
        self.task: asyncio.Task | None = None
        self.report: P.FilterReport | None = None  # dynamic_group_filter's, once done
        self.waiters = 0  # callers still waiting: when the last one goes away, so does the engine work
        self._tick = asyncio.Event()

    def add(self, index: int, group: P.Group) -> None:
        self.groups[index] = group
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def events(self):
        """(index, group) as each group finishes, replaying those already done; then the task's exception, if any."""
        sent = 0
        while True:
            tick = self._tick
            items = list(self.groups.items())
            for item in items[sent:]:
                yield item
            sent = len(items)
            if self.task.done() and sent == len(self.groups):
                break
            waiter = asyncio.ensure_future(tick.wait())
            await asyncio.wait({self.task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        if self.task.cancelled():
            raise RolloutCancelled()
        self.task.result()


def _finish(coro):
    """Run a weight push to its end even if its caller goes away: a push cut between its phases is not atomic."""
    return asyncio.shield(asyncio.ensure_future(coro))


def _rollout_error(job: Job, e: BaseException) -> JSONResponse:
    if isinstance(e, (asyncio.CancelledError, RolloutCancelled)):
        return _error(409, "request cancelled (DELETE /v1/rollouts/{request_id}); send it again to generate anew")
    if isinstance(e, (BackPressureError, ReplicaFull)):
        return JSONResponse(status_code=429, headers={"Retry-After": "1"},
                            content=P.ErrorResponse(error="engine queues are full (FARM_ENGINE_MAX_QUEUED_REQUESTS): retry after 1 s").model_dump())
    if isinstance(e, VersionNotReached):
        return _error(409, str(e), [{"field": "min_weight_version", "message": "push that version first, or ask for one that is committed"}])
    raise e


@serve.ingress(api)
class Ingress:
    def __init__(self, engine: DeploymentHandle, settings: ServiceSettings):
        self.engine, self.settings = engine, settings
        self.spec: dict | None = None
        self.vocab: int | None = None
        load_plugins(settings)
        self.push_lock = asyncio.Lock()
        self.committed = 0  # the newest version this ingress has seen committed: no rollout runs on older weights
        self.jobs: OrderedDict[str, Job] = OrderedDict()  # request_id -> job, for replays and cancellation
        self.stats = P.PolicyStats()  # what the trainer last reported
        self.temperatures: dict[str, float] = {}
        self.queue = TrajectoryQueue(self._generate_for_queue, lambda: self.committed, batch_groups=4 * settings.replicas)

    def _auth_error(self, request: Request) -> JSONResponse | None:
        """None when the request carries the bearer token (compared in constant time), else the 401 to return."""
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.settings.api_token.get_secret_value()}".encode()):
            return None
        return _error(401, "missing or wrong bearer token: send 'Authorization: Bearer $FARM_API_TOKEN'")

    @api.post("/v1/rollouts", response_model=P.RolloutResponse, responses={409: {"model": P.ErrorResponse}, 422: {"model": P.ErrorResponse}, 429: {"model": P.ErrorResponse}})
    async def rollouts(self, req: P.RolloutRequest):
        """Generate `n` samples for each prompt and score them; one group per prompt, in order.

        With `stream`, the answer is NDJSON: a GroupEvent line per group as it finishes, then a StreamEnd line.
        With a `request_id`, a repeat of the same request (also one still running) gets the first
        result back and generates nothing; the same id with a different body gets 409.
        DELETE /v1/rollouts/{request_id} cancels it, and so does the last waiting caller closing its connection.
        """
        if bad := await self._check(req):
            return bad
        fingerprint = hashlib.sha256(req.model_dump_json(exclude={"request_id", "stream"}).encode()).hexdigest()
        job = self.jobs.get(req.request_id) if req.request_id else None
        if job is not None and job.fingerprint != fingerprint:
            return _error(409, f"request_id {req.request_id!r} was used for a different request: use a new id")
        if job is not None:
            metrics.REPLAYS.inc()
        else:
            job = Job(fingerprint, len(req.prompts))
            # In a context of its own: Serve cancels the engine calls made in a request's context when its caller leaves,
            # and this job outlives its first caller by FARM_DISCONNECT_GRACE_S (see _abandoned).
            job.task = contextvars.Context().run(asyncio.create_task, self._produce(job, req))
            if req.request_id:
                self.jobs[req.request_id] = job
                while len(self.jobs) > self.settings.idempotency_cache_size:  # forget the oldest finished ones
                    if (old := next((rid for rid, j in self.jobs.items() if j.task.done()), None)) is None:
                        break
                    del self.jobs[old]
                job.task.add_done_callback(lambda t, rid=req.request_id, job=job: self._forget_failed(rid, job))
        if req.stream:
            return StreamingResponse(self._stream(job, req.request_id), media_type="application/x-ndjson")
        job.waiters += 1
        try:
            await asyncio.wait({job.task})
        except asyncio.CancelledError:  # our caller went away: its engine work goes too, unless another caller waits
            job.waiters -= 1
            self._abandoned(job, req.request_id)
            raise
        job.waiters -= 1
        if job.task.cancelled() or job.task.exception():
            return _rollout_error(job, job.task.exception() if not job.task.cancelled() else asyncio.CancelledError())
        return job.task.result()

    def _forget_failed(self, request_id: str, job: Job) -> None:
        """A failed or cancelled request is not remembered: a retry generates again."""
        if (job.task.cancelled() or job.task.exception() is not None) and self.jobs.get(request_id) is job:
            del self.jobs[request_id]

    def _abandoned(self, job: Job, request_id: str | None) -> None:
        """A caller went away. With none left, the engine work is cancelled: at once without a request_id, else after
        FARM_DISCONNECT_GRACE_S unless a retry under the same id (a client whose read timed out) is waiting for it by then."""
        if job.waiters > 0:
            return
        if not request_id or self.settings.disconnect_grace_s == 0:
            job.task.cancel()
            return
        asyncio.get_running_loop().call_later(self.settings.disconnect_grace_s, lambda: job.waiters == 0 and job.task.cancel())

    async def _stream(self, job: Job, request_id: str | None):
        job.waiters += 1
        try:
            async for index, group in job.events():
                yield P.GroupEvent(index=index, group=group).model_dump_json() + "\n"
            yield P.StreamEnd(groups=len(job.groups), filter=job.report).model_dump_json() + "\n"
        except (asyncio.CancelledError, GeneratorExit):
            job.waiters -= 1
            self._abandoned(job, request_id)
            raise
        except Exception as e:
            try:
                answer = _rollout_error(job, e)
                status, message = answer.status_code, json.loads(answer.body)["error"]
            except Exception:
                status, message = 500, f"internal error: {type(e).__name__}; see the service log"
            yield P.StreamEnd(groups=len(job.groups), error=message, status=status).model_dump_json() + "\n"

    @api.delete("/v1/rollouts/{request_id}", response_model=P.CancelResponse, responses={401: {"model": P.ErrorResponse}})
    async def cancel_rollout(self, request: Request, request_id: str):
        """Cancel a running rollout by its request_id (needs the token); its engine work stops at the next token."""
        if denied := self._auth_error(request):
            return denied
        job = self.jobs.get(request_id)
        if job is None or job.task.done():
            return P.CancelResponse(request_id=request_id, cancelled=False)
        self.jobs.pop(request_id, None)
        job.task.cancel()
        log.info(json.dumps({"event": "rollout_cancelled", "request_id": request_id}))
        return P.CancelResponse(request_id=request_id, cancelled=True)

    async def _check(self, req: P.RolloutRequest | P.QueueSource) -> JSONResponse | None:
        """A 422 for what pydantic cannot know: unknown names, out-of-vocabulary tokens, bad sampler params."""
        if req.reward is not None and req.reward not in rewards.REWARDS.names():  # registered names only: no imports from requests
            return _invalid([{"field": "reward", "message": f"unknown reward {req.reward!r}; valid names: {', '.join(rewards.REWARDS.names())} (add your own with FARM_PLUGINS)"}])
        if bad := self._sampler_problems(req.sampler, "sampler", len(req.prompts) if isinstance(req, P.RolloutRequest) else None):
            return _invalid(bad)
        return await self._check_tokens(req.prompts)

    def _sampler_problems(self, spec: P.SamplerSpec, field: str, prompts: int | None) -> list[dict]:
        """422 detail for a sampler spec (and a filter's inner one): its name, its params, and what they mean for this request."""
        try:
            sampler = make_sampler(spec, self.settings.plugins)
        except KeyError as e:
            return [{"field": f"{field}.name", "message": e.args[0]}]
        except ValidationError as e:
            return _fields(e.errors(), field, "params")
        bad = [{**b, "field": f"{field}.params.{b['field']}"} for b in sampler.problems(prompts, self.settings.engine)]
        return bad + (self._sampler_problems(sampler.params.inner, f"{field}.params.inner", prompts) if sampler.filters_groups else [])

    async def _check_tokens(self, prompts: list[P.Prompt]) -> JSONResponse | None:
        if self.vocab is None:
            self.vocab = await self.engine.vocab_size.remote()
        bad = [{"field": f"prompts.{i}.token_ids", "message": f"token ids must be in [0, {self.vocab}): the model's vocabulary"}
               for i, p in enumerate(prompts) if p.token_ids and not all(0 <= t < self.vocab for t in p.token_ids)]
        return _invalid(bad) if bad else None

    def _plan(self, spec: P.SamplerSpec, sampler, sampling: P.SamplingParams) -> tuple[P.SamplingParams, dict]:
        params, meta = sampler.plan(sampling, SamplerState(stats=self.stats, weight_version=self.committed))
        self._note_temperature(spec.name, params.temperature)
        return params, {"sampler": spec.name, **meta}

    async def _produce(self, job: Job, req: P.RolloutRequest, delivered: bool = True) -> P.RolloutResponse:
        """Spread the groups over the replicas (a group stays on one), recording each part as it finishes."""
        sampler = make_sampler(req.sampler, self.settings.plugins)
        if sampler.filters_groups:
            return await self._produce_filtered(job, req, sampler, delivered)
        k = self.settings.replicas * (2 if req.stream else 1)  # finer parts when streaming, so groups arrive sooner
        chunks = _split(list(range(len(req.prompts))), k)
        min_version = max(req.min_weight_version, self.committed)
        params, meta = self._plan(req.sampler, sampler, req.sampling_params)
        calls = [self.engine.rollout.remote([req.prompts[i] for i in c], req.n, _chunk_params(params, j), req.reward, min_version, meta, req.sampler)
                 for j, c in enumerate(chunks)]

        async def part(chunk, call):
            for i, group in zip(chunk, await call):
                group.prompt_index = i
                job.add(i, group)

        try:
            await asyncio.gather(*[part(c, call) for c, call in zip(chunks, calls)])
        except BaseException:
            for call in calls:  # frees the engine work of every part still running
                call.cancel()
            raise
        groups = [job.groups[i] for i in range(job.size)]
        self._count(req.sampler.name, groups, groups if delivered else [])
        return P.RolloutResponse(groups=groups)

    async def _produce_filtered(self, job: Job, req: P.RolloutRequest, flt, delivered: bool) -> P.RolloutResponse:
        """dynamic_group_filter: engine calls of prompts_per_call prompts, at most replicas x FARM_ENGINE_MAX_ONGOING_REQUESTS
        at once, until target_groups informative groups are kept or max_groups were started; then the running calls are cancelled."""
        p = flt.params
        params, meta = self._plan(p.inner, make_sampler(p.inner, self.settings.plugins), req.sampling_params)
        meta = {**meta, "filter": req.sampler.name}
        target, cap = p.target_groups or len(req.prompts), min(p.max_groups or len(req.prompts), len(req.prompts))
        todo = deque((j, list(range(a, min(a + p.prompts_per_call, cap)))) for j, a in enumerate(range(0, cap, p.prompts_per_call)))
        window = max(1, self.settings.replicas * self.settings.engine_max_ongoing_requests)  # shrinks when Serve pushes back
        min_version = max(req.min_weight_version, self.committed)
        running: dict[asyncio.Future, tuple[int, list[int], object]] = {}  # -> (chunk index, prompt indices, Serve response)
        finished: list[tuple[str, P.Group]] = []  # (outcome, group) in finishing order
        kept = pushbacks = 0

        async def wait(call):
            return await call

        try:
            while kept < target:
                while len(running) < window and todo:
                    j, chunk = todo.popleft()
                    call = self.engine.rollout.remote([req.prompts[i] for i in chunk], req.n, _chunk_params(params, j), req.reward, min_version, meta, p.inner)
                    running[asyncio.ensure_future(wait(call))] = (j, chunk, call)
                if not running:
                    break
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    j, chunk, _ = running.pop(fut)
                    if isinstance(fut.exception(), (BackPressureError, ReplicaFull)) and pushbacks < 100:  # queues full: again once a call finishes
                        pushbacks += 1
                        todo.appendleft((j, chunk))
                        window = max(1, len(running))
                        if not running:
                            await asyncio.sleep(0.1)
                        continue
                    for i, group in zip(chunk, fut.result()):
                        group.prompt_index = i
                        outcome = "zero_variance" if flt.zero_variance(group) else "kept" if kept < target else "surplus"
                        finished.append((outcome, group))
                        if outcome == "kept":
                            kept += 1
                            job.add(i, group)
        finally:
            cancelled = sum(len(chunk) for _, chunk, _ in running.values())
            for fut, (_, _, call) in running.items():  # the surplus: its engine work stops at the next token
                call.cancel()
                fut.cancel()
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" noise
        job.report = report = self._filter_report(target, finished, cancelled)
        groups = [job.groups[i] for i in sorted(job.groups)]
        self._count(req.sampler.name, [g for _, g in finished], groups if delivered else [])  # the engine work: the zero-variance fraction
        log.info(json.dumps({"event": "group_filter", **report.model_dump()}))
        return P.RolloutResponse(groups=groups, filter=report)

    @staticmethod
    def _filter_report(target: int, finished: list[tuple[str, P.Group]], cancelled: int) -> P.FilterReport:
        count = Counter(outcome for outcome, _ in finished)
        generated = sum(g.generated_tokens or 0 for _, g in finished)  # every candidate of every finished group
        kept_tokens = sum(len(s.token_ids) for o, g in finished if o == "kept" for s in g.samples)
        for outcome in ("kept", "zero_variance", "surplus"):
            metrics.FILTER_GROUPS.labels(outcome).inc(count[outcome])
        metrics.FILTER_GROUPS.labels("cancelled").inc(cancelled)
        metrics.FILTER_WASTED_TOKENS.inc(generated - kept_tokens)
        return P.FilterReport(target_groups=target, target_reached=count["kept"] >= target, generated_groups=len(finished), kept_groups=count["kept"],
                              zero_variance_groups=count["zero_variance"], zero_variance_fraction=count["zero_variance"] / max(1, len(finished)),
                              surplus_groups=count["surplus"], cancelled_groups=cancelled, generated_tokens=generated, kept_tokens=kept_tokens,
                              waste_fraction=1 - kept_tokens / generated if generated else 0.0)

    async def _generate_for_queue(self, req: P.RolloutRequest) -> list[P.Group]:
        return (await self._produce(Job("", len(req.prompts)), req, delivered=False)).groups

    def _note_temperature(self, sampler: str, temperature: float) -> None:
        """Export the temperature a sampler chose, and log each change."""
        if self.temperatures.get(sampler) != temperature:
            log.info(json.dumps({"event": "sampler_temperature", "sampler": sampler, "temperature": round(temperature, 4),
                                 "was": self.temperatures.get(sampler), "kl": self.stats.kl}))
            self.temperatures[sampler] = temperature
        metrics.SAMPLER_TEMPERATURE.labels(sampler).set(temperature)

    def _count(self, sampler: str, groups: list[P.Group], delivered: list[P.Group]) -> None:
        """Per-sampler counts of the groups generated, and the staleness of those delivered now (queued ones count when pulled)."""
        metrics.GROUPS.labels(sampler).inc(len(groups))
        metrics.ZERO_VAR.labels(sampler).inc(sum(g.zero_variance for g in groups))
        metrics.SAMPLES.labels(sampler).inc(sum(len(g.samples) for g in groups))
        metrics.TOKENS.labels(sampler).inc(sum(len(s.token_ids) for g in groups for s in g.samples))
        metrics.CANDIDATES.labels(sampler).inc(sum(g.candidates or 0 for g in groups))
        metrics.REJECTED.labels(sampler).inc(sum(g.rejected or 0 for g in groups))
        for s in (s for g in delivered for s in g.samples):
            metrics.STALENESS.observe(max(0, self.committed - s.weight_version))

    @api.post("/v1/queue/sources", response_model=P.QueueSourceState, responses={401: {"model": P.ErrorResponse}, 409: {"model": P.ErrorResponse}, 422: {"model": P.ErrorResponse}})
    async def queue_add_source(self, request: Request, spec: P.QueueSource):
        """Register a prompt source; the service starts generating groups from it in the background."""
        if denied := self._auth_error(request):
            return denied
        if bad := await self._check(spec):
            return bad
        try:
            return self.queue.add_source(spec)
        except SourceExists as e:
            return _error(409, str(e))

    @api.get("/v1/queue/sources", response_model=list[P.QueueSourceState])
    async def queue_sources(self):
        """Every source: queued prompts, ready and leased groups, acks, redeliveries and stale drops."""
        return self.queue.states()

    @api.delete("/v1/queue/sources/{name}", response_model=P.QueueSourceState, responses={401: {"model": P.ErrorResponse}, 404: {"model": P.ErrorResponse}})
    async def queue_remove_source(self, request: Request, name: str):
        """Stop a source and forget its groups (leased ones included)."""
        if denied := self._auth_error(request):
            return denied
        try:
            return self.queue.remove(name)
        except NoSource as e:
            return _error(404, str(e))

    @api.post("/v1/queue/sources/{name}/prompts", response_model=P.QueueSourceState,
              responses={401: {"model": P.ErrorResponse}, 404: {"model": P.ErrorResponse}, 413: {"model": P.ErrorResponse}, 422: {"model": P.ErrorResponse}},
              openapi_extra={"requestBody": {"content": {"application/json": {"schema": P.QueuePrompts.model_json_schema()},
                                                         "application/x-ndjson": {"schema": {"type": "string", "description": "One Prompt per line (JSONL)"}}}}})
    async def queue_add_prompts(self, request: Request, name: str):
        """Add prompts to a source: a JSON QueuePrompts body, or an uploaded JSONL file (Content-Type application/x-ndjson), one Prompt per line."""
        if denied := self._auth_error(request):
            return denied
        limit = self.settings.max_upload_bytes
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return _error(413, f"body larger than FARM_MAX_UPLOAD_BYTES={limit}: send the prompts in parts")
        if request.headers.get("content-type", "application/json").split(";")[0].strip() == "application/json":
            try:
                prompts, errors = P.QueuePrompts.model_validate_json(bytes(body)).prompts, []
            except ValidationError as e:
                prompts, errors = [], _fields(e.errors())
        else:
            prompts, errors = _jsonl_prompts(bytes(body))
        if errors:
            return _invalid(errors)
        if bad := await self._check_tokens(prompts):
            return bad
        try:
            return self.queue.add_prompts(name, prompts)
        except NoSource as e:
            return _error(404, str(e))

    @api.post("/v1/queue/pull", response_model=P.PullResponse, responses={401: {"model": P.ErrorResponse}, 404: {"model": P.ErrorResponse}, 422: {"model": P.ErrorResponse}})
    async def queue_pull(self, request: Request, req: P.PullRequest):
        """Lease up to max_groups ready groups (waiting up to wait_s for one); needs the token. Ack them before lease_s
        runs out, or they are delivered again (same item_id). Groups older than max_staleness versions are dropped and generated again."""
        if denied := self._auth_error(request):
            return denied
        try:
            return await self.queue.pull(req)
        except NoSource as e:
            return _error(404, str(e))

    @api.post("/v1/queue/ack", response_model=P.AckResponse, responses={401: {"model": P.ErrorResponse}})
    async def queue_ack(self, request: Request, req: P.AckRequest):
        """Settle groups the trainer has used (needs the token); they are never delivered again. Acking twice is harmless."""
        if denied := self._auth_error(request):
            return denied
        return self.queue.ack(req.item_ids)

    @api.post("/v1/policy_stats", response_model=P.PolicyStats, responses={401: {"model": P.ErrorResponse}, 422: {"model": P.ErrorResponse}})
    async def report_policy_stats(self, request: Request, stats: P.PolicyStats):
        """The trainer reports its policy statistics (needs the token); samplers read them from the next request on.
        Fields left out keep their last value."""
        if denied := self._auth_error(request):
            return denied
        self.stats = self.stats.model_copy(update=stats.model_dump(exclude_unset=True))
        for gauge, value in ((metrics.POLICY_KL, self.stats.kl), (metrics.POLICY_REWARD_VAR, self.stats.reward_var), (metrics.POLICY_STEP, self.stats.step)):
            if value is not None:
                gauge.set(value)
        log.info(json.dumps({"event": "policy_stats", **self.stats.model_dump()}))
        return self.stats

    @api.get("/v1/policy_stats", response_model=P.PolicyStats)
    async def policy_stats(self):
        """The statistics the trainer last reported."""
        return self.stats

    @api.get("/v1/samplers")
    async def samplers(self) -> dict[str, str]:
        """Registered samplers and what each does."""
        return {name: (samplers.SAMPLERS.get(name).__doc__ or "").strip() for name in samplers.SAMPLERS.names()}

    @api.post("/v1/completions", responses={422: {"model": P.ErrorResponse}})
    async def completions(self, req: P.CompletionRequest):
        """OpenAI-compatible text completion by the current policy (for lm-eval and similar tools)."""
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        return await self._openai("text_completion", prompts, req.n, openai_compat.sampling(req.max_tokens, req.temperature, req.top_p, req.seed), req.stop, req.logprobs is not None)

    @api.post("/v1/chat/completions", responses={422: {"model": P.ErrorResponse}})
    async def chat_completions(self, req: P.ChatCompletionRequest):
        """OpenAI-compatible chat completion; the messages go through the model's chat template."""
        text = await self.engine.render_chat.remote([m.model_dump() for m in req.messages])
        if text is None:
            return _error(422, "the served model has no chat template: use /v1/completions", [{"field": "messages", "message": "no chat template"}])
        params = openai_compat.sampling(req.max_completion_tokens or req.max_tokens or 256, req.temperature, req.top_p, req.seed)
        return await self._openai("chat.completion", [text], req.n, params, req.stop, req.logprobs)

    async def _openai(self, kind: str, prompts: list[str], n: int, params: P.SamplingParams, stop, logprobs: bool):
        try:
            rollout = P.RolloutRequest(prompts=[P.Prompt(text=p) for p in prompts], n=n, sampling_params=params)
        except ValidationError as e:
            return _invalid([{"field": "prompt", "message": err["msg"]} for err in e.errors()])
        job = Job("", len(prompts))
        try:
            result = await self._produce(job, rollout)
        except Exception as e:
            return _rollout_error(job, e)
        pieces = await self.engine.token_pieces.remote([s.token_ids for g in result.groups for s in g.samples]) if logprobs else None
        return openai_compat.response(kind, os.path.basename(self.settings.model.rstrip("/")), result.groups, stop, kind == "chat.completion", pieces)

    @api.post("/v1/weights", response_model=P.WeightsPushResponse, responses={401: {"model": P.ErrorResponse}, 409: {"model": P.ErrorResponse}, 413: {"model": P.ErrorResponse}, 422: {"model": P.ErrorResponse}})
    async def push_weights(self, request: Request, version: int = Query(..., ge=1, description="The new version; higher than the served one."),
                           policy: P.InFlightPolicy = Query("finish", description="In-flight samples: finish on the old weights, abort and rerun, or go on (partial)."),
                           x_content_sha256: str | None = Header(None, description="Hex SHA-256 of the body; a mismatch is refused.")):
        """Upload a safetensors state dict (raw body, streamed) as `version`. Two phases: every replica
        stages it, then all commit; if any replica refuses, none changes. Returns once all serve it."""
        if denied := self._auth_error(request):
            return denied
        limit = self.settings.max_weights_bytes
        if int(request.headers.get("content-length") or 0) > limit:
            return _error(413, f"upload larger than FARM_MAX_WEIGHTS_BYTES={limit}")
        data, digest = bytearray(), hashlib.sha256()
        async for chunk in request.stream():
            data += chunk
            digest.update(chunk)
            if len(data) > limit:
                return _error(413, f"upload larger than FARM_MAX_WEIGHTS_BYTES={limit}")
        if x_content_sha256 and not hmac.compare_digest(x_content_sha256.lower(), digest.hexdigest()):
            return _invalid([{"field": "x-content-sha256", "message": f"body has SHA-256 {digest.hexdigest()}, not {x_content_sha256}: the upload was damaged; send it again"}])
        data = bytes(data)

        async def check(spec):
            return check_upload(data, spec)

        return await _finish(self._push(version, policy, check, lambda: ("bytes", [ray.put(data)]), len(data)))

    @api.post("/v1/weights/path", response_model=P.WeightsPushResponse, responses={401: {"model": P.ErrorResponse}, 409: {"model": P.ErrorResponse}, 422: {"model": P.ErrorResponse}})
    async def push_weights_path(self, request: Request, body: P.WeightsFromPath):
        """Load a folder of safetensors files from storage every replica can read (no upload), in the same two phases.
        Keep the folder until a newer version is committed: replicas that start later load it from there."""
        if denied := self._auth_error(request):
            return denied
        folder = pathlib.Path(body.path).resolve()
        root = self.settings.weights_dir
        if root and not folder.is_relative_to(pathlib.Path(root).resolve()):
            return _invalid([{"field": "path", "message": f"{body.path} is outside FARM_WEIGHTS_DIR={root}"}])
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if not files:
            return _invalid([{"field": "path", "message": f"no *.safetensors files in {body.path}: give a folder the service can read"}])

        async def check(spec):
            got = {}
            for f in files:
                got.update(await asyncio.to_thread(read_header_file, f))
            if problems := check_state_dict(spec, got):
                raise WeightsError(problems)
            return len(got)

        return await _finish(self._push(body.version, body.policy, check, lambda: ("path", str(folder)), sum(f.stat().st_size for f in files)))

    async def _push(self, version: int, policy: str, check, source, size: int):
        async with self.push_lock:
            start = time.perf_counter()
            current = max(v for _, v in await self.engine.broadcast("weight_version").results_async(timeout_s=30))
            if version <= current:
                return _error(409, f"version {version} is not newer than the served version {current}: push version {current + 1} or higher")
            if self.spec is None:
                self.spec = await self.engine.weight_spec.remote()
            try:
                tensors = await check(self.spec)
            except WeightsError as e:
                return _error(422, "weights refused; the old version keeps serving", [{"field": "body", "message": m} for m in e.problems])
            source, timeout = source(), self.settings.weight_sync_timeout_s
            failed = await self._broadcast("stage", timeout, source, version)
            if failed:
                await self.engine.broadcast("discard", version).results_async(timeout_s=30, return_exceptions=True)
                log.error(json.dumps({"event": "weight_stage_failed", "version": version, "errors": failed}))
                return _error(500, f"{len(failed)} replicas failed to stage version {version}; every replica stays on version {current}",
                              [{"field": "replica", "message": f} for f in failed])
            await self.engine.record.remote(version, source)  # first: a replica that starts from now on loads this version
            if failed := await self._broadcast("commit", timeout, version, policy, source):
                log.error(json.dumps({"event": "weight_commit_failed", "version": version, "errors": failed}))
                return _error(500, f"{len(failed)} replicas failed to commit version {version}", [{"field": "replica", "message": f} for f in failed])
            self.committed = version
            seconds = time.perf_counter() - start
        metrics.VERSION.set(version)
        metrics.SYNC_SECONDS.observe(seconds)
        metrics.SYNC_BYTES.inc(size)
        log.info(json.dumps({"event": "weights_pushed", "version": version, "bytes": size, "policy": policy, "seconds": round(seconds, 3)}))
        return P.WeightsPushResponse(version=version, tensors=tensors, bytes=size, seconds=seconds)

    async def _broadcast(self, method: str, timeout: float, *args) -> list[str]:
        """Call `method` on every replica; the failures, one line each ([] when all succeed)."""
        try:
            results = await self.engine.broadcast(method, *args).results_async(timeout_s=timeout, return_exceptions=True)
        except TimeoutError:
            return [f"replicas did not finish {method} within FARM_WEIGHT_SYNC_TIMEOUT_S={timeout}"]
        return [str(r).strip().splitlines()[-1] for r in results if isinstance(r, Exception)]

    @api.post("/v1/weights/distributed/init", responses={401: {"model": P.ErrorResponse}, 501: {"model": P.ErrorResponse}})
    async def init_distributed(self, request: Request, body: P.DistributedGroup):
        """Join every replica to the trainer's NCCL group (SGLang's init_weights_update_group); replica i takes rank rank_offset + i."""
        if denied := self._auth_error(request):
            return denied
        return await _finish(self._distributed("init_weights_update_group", body))

    @api.post("/v1/weights/distributed", responses={401: {"model": P.ErrorResponse}, 501: {"model": P.ErrorResponse}})
    async def push_distributed(self, request: Request, body: P.DistributedUpdate):
        """Receive tensors the trainer broadcasts over NCCL (SGLang's update_weights_from_distributed) as `version`."""
        if denied := self._auth_error(request):
            return denied
        return await _finish(self._distributed("update_weights_from_distributed", body))

    async def _distributed(self, method: str, body):
        async with self.push_lock:
            served = dict(await self.engine.broadcast("weight_version").results_async(timeout_s=30))
            ids, current = sorted(served), max(served.values())
            if isinstance(body, P.DistributedUpdate) and body.version <= current:
                return _error(409, f"version {body.version} is not newer than the served version {current}: send version {current + 1} or higher")
            try:  # every replica gets the sorted replica ids, so each knows its own rank
                results = await self.engine.broadcast(method, body, ids).results_async(timeout_s=self.settings.weight_sync_timeout_s)
            except NotImplementedError as e:
                return _error(501, str(e).strip().splitlines()[-1])
        if isinstance(body, P.DistributedUpdate):
            self.committed = max(self.committed, body.version)
            metrics.VERSION.set(body.version)
        return {"replicas": len(results), "results": results}

    @api.get("/v1/weights/version", response_model=P.WeightsVersion)
    async def weights_version(self):
        """The version every replica serves, and each replica's own."""
        replicas = dict(await self.engine.broadcast("weight_version").results_async(timeout_s=30))
        self.committed = max(self.committed, min(replicas.values()))
        return P.WeightsVersion(version=min(replicas.values()), replicas=replicas)

    @api.get("/healthz", response_model=P.Health)
    async def healthz(self):
        """Alive: an engine replica generates a token (or reports that sampling is paused)."""
        return await self.engine.health.remote()

    @api.get("/readyz", response_model=P.Readiness, responses={503: {"model": P.ErrorResponse}})
    async def readyz(self):
        """Ready for rollouts: no replica is paused and every replica serves the same weight version."""
        states = await self.engine.broadcast("control", "none").results_async(timeout_s=30, return_exceptions=True)
        problems = [str(s) for s in states if isinstance(s, Exception)]
        problems += [f"replica {s.replica} is paused" for s in states if not isinstance(s, Exception) and s.paused]
        if len({s.weight_version for s in states if not isinstance(s, Exception)}) > 1:
            problems.append("replicas serve different weight versions")
        if problems:
            return _error(503, "not ready", [{"field": "replica", "message": m} for m in problems])
        return P.Readiness(ready=True, replicas=states)

    @api.post("/v1/pause", response_model=P.ControlResponse, responses={401: {"model": P.ErrorResponse}})
    async def pause(self, request: Request):
        """Stop admitting generation on every replica; calls already running finish (or see /v1/abort)."""
        return await self._control(request, "pause")

    @api.post("/v1/resume", response_model=P.ControlResponse, responses={401: {"model": P.ErrorResponse}})
    async def resume(self, request: Request):
        """Admit generation again on every replica."""
        return await self._control(request, "resume")

    @api.post("/v1/abort", response_model=P.ControlResponse, responses={401: {"model": P.ErrorResponse}})
    async def abort(self, request: Request):
        """End the generation each replica is running at its next token; its samples finish with 'abort'."""
        return await self._control(request, "abort")

    async def _control(self, request: Request, action: str):
        if denied := self._auth_error(request):
            return denied
        states = await self.engine.broadcast("control", action).results_async(timeout_s=30)
        log.info(json.dumps({"event": "control", "action": action, "replicas": len(states)}))
        return P.ControlResponse(action=action, replicas=states)

    @api.get("/metrics")
    async def prometheus(self):
        """Prometheus metrics: the ingress's own, each replica's version and tokens, and the trajectory queue's."""
        states = await self.engine.broadcast("control", "none").results_async(timeout_s=10, return_exceptions=True)
        metrics.REPLICA_VERSION.clear()
        metrics.REPLICA_TOKENS.clear()
        for st in states:
            if not isinstance(st, Exception):
                metrics.REPLICA_VERSION.labels(st.replica).set(st.weight_version)
                metrics.REPLICA_TOKENS.labels(st.replica).set(st.generated_tokens)
        self.queue.states()  # sets the queue gauges
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def build_app(settings: ServiceSettings):
    """The Serve application for these settings."""
    scaling = {"num_replicas": settings.replicas}
    if settings.max_replicas > settings.replicas:  # Serve's autoscaler, driven by ongoing requests per replica
        scaling = {"autoscaling_config": {"min_replicas": settings.replicas, "initial_replicas": settings.replicas, "max_replicas": settings.max_replicas,
                                          "target_ongoing_requests": settings.target_ongoing_requests}}
    engine = serve.deployment(
        EngineServer, name="engine", **scaling, max_ongoing_requests=settings.engine_max_ongoing_requests + CONTROL_SLOTS,
        max_queued_requests=settings.engine_max_queued_requests,
        ray_actor_options={"num_cpus": settings.engine_num_cpus},
        deployment_actors=[DeploymentActorConfig(name="weights", actor_class=WeightStore)],
    )
    ingress = serve.deployment(Ingress, name="ingress", max_ongoing_requests=settings.ingress_max_ongoing_requests, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(settings), settings)
