"""The rollout service: a FastAPI ingress deployment in front of engine replicas, on Ray Serve.

  HTTP ─► Ingress (validation, auth, metrics) ─► EngineServer × replicas (tokenize, generate, reward)
                     └─ weight push: header check, then broadcast to every replica ─┘
                                                  WeightStore (deployment actor): the committed
                                                  version, loaded by a replica before it serves
"""

import asyncio
import hashlib
import hmac
import importlib
import json
import logging
import os
import statistics
import time
from collections import OrderedDict

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from ray import serve
from ray.serve.config import DeploymentActorConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from services import metrics, openai_compat
from services import protocol as P
from services.rewards import REWARDS
from services.settings import ServiceSettings
from services.weights import WeightsError, check_upload

log = logging.getLogger("farm.service")


@ray.remote(num_cpus=0)
class WeightStore:
    """The committed weight version and its safetensors bytes, so a new replica can catch up."""

    def __init__(self):
        self.version, self.refs = 0, []

    def commit(self, version: int, data: bytes) -> None:
        if version > self.version:  # ray.put here, so the store owns the copy and it outlives the sender
            self.version, self.refs = version, [ray.put(data)]

    def current(self) -> tuple[int, list]:
        return self.version, self.refs


def load_plugins(settings: ServiceSettings) -> None:
    """Import the modules named in FARM_PLUGINS so that their registrations run."""
    for module in settings.plugins:
        importlib.import_module(module)


class EngineServer:
    """One engine replica: tokenizes, generates, decodes and scores."""

    async def __init__(self, settings: ServiceSettings):
        from services.engine.torch_engine import TorchEngine
        from services.models import resolve_model

        load_plugins(settings)
        threads = settings.engine_threads or max(1, (os.cpu_count() or 1) // settings.replicas)
        self.engine = TorchEngine(str(resolve_model(settings.model)), settings.device, settings.dtype, threads)
        self.tok = self.engine.tokenizer
        version, refs = await serve.get_deployment_actor("weights").current.remote()
        if version > 0:  # catch up before Serve routes any traffic here
            await self.update_weights(refs, version)

    async def rollout(self, prompts: list[P.Prompt], n: int, params: P.SamplingParams, reward: str | None) -> list[P.Group]:
        ids = [p.token_ids if p.token_ids is not None else self.tok(p.text, add_special_tokens=False).input_ids for p in prompts]
        outs = await asyncio.to_thread(self.engine.generate, [x for x in ids for _ in range(n)], params)
        score = REWARDS.get(reward) if reward else None
        groups = []
        for i, prompt in enumerate(prompts):
            samples = []
            for o in outs[i * n:(i + 1) * n]:
                text = self.tok.decode(o.token_ids, skip_special_tokens=True)
                reason, r = o.finish_reason, 0.0
                try:
                    r = float(score(text, prompt.ground_truth)) if score else 0.0
                except Exception as e:  # one bad score marks its sample, not the batch
                    log.warning(json.dumps({"event": "reward_failed", "reward": reward, "error": repr(e)}))
                    reason = "error"
                samples.append(P.Sample(token_ids=o.token_ids, logprobs=o.logprobs, text=text, finish_reason=reason, reward=r, weight_version=o.weight_version))
            rewards = [s.reward for s in samples]
            std = statistics.pstdev(rewards)
            groups.append(P.Group(prompt_token_ids=ids[i], samples=samples, reward_mean=statistics.fmean(rewards), reward_std=std, zero_variance=std < 1e-6))
        return groups

    async def update_weights(self, refs: list, version: int) -> int:
        """Load the safetensors bytes behind refs[0] as `version` (a no-op if already there)."""
        from safetensors.torch import load

        if version > self.engine.weight_version:
            data = await refs[0]
            await asyncio.to_thread(self.engine.update_weights, load(data), version)
            store = serve.get_deployment_actor("weights")  # looked up each time: Serve may recreate it
            stored, _ = await store.current.remote()
            if stored < version:
                await store.commit.remote(version, data)
        return self.engine.weight_version

    def weight_spec(self) -> dict:
        return self.engine.weight_spec()

    def render_chat(self, messages: list[dict]) -> str | None:
        """Messages through the model's chat template, ready for generation; None without a template."""
        if not self.tok.chat_template:
            return None
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def vocab_size(self) -> int:
        return max(len(self.tok), self.engine.model.config.vocab_size)

    def weight_version(self) -> tuple[str, int]:
        """(this replica's id, the version it serves)."""
        return serve.get_replica_context().replica_id.unique_id, self.engine.weight_version

    async def health(self) -> P.Health:
        if self.engine.paused:
            return P.Health(status="paused", weight_version=self.engine.weight_version)
        token = await asyncio.to_thread(self.engine.health)
        return P.Health(status="ok", weight_version=self.engine.weight_version, generated_token_id=token)

    def control(self, action: str) -> P.ReplicaState:
        """Pause or resume admitting generate calls, or abort the one in flight."""
        {"pause": self.engine.pause, "resume": self.engine.resume, "abort": self.engine.abort, "none": lambda: None}[action]()
        return P.ReplicaState(replica=serve.get_replica_context().replica_id.unique_id, weight_version=self.engine.weight_version, paused=self.engine.paused)


api = FastAPI(title="rollout-farm", version=P.API_VERSION, description="Rollout service for LLM reinforcement learning.")


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    detail = [{"field": ".".join(str(x) for x in e["loc"] if x != "body"), "message": e["msg"]} for e in exc.errors()]
    return _invalid(detail)


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


@serve.ingress(api)
class Ingress:
    def __init__(self, engine: DeploymentHandle, settings: ServiceSettings):
        self.engine, self.settings = engine, settings
        self.spec: dict | None = None
        self.vocab: int | None = None
        load_plugins(settings)
        self.push_lock = asyncio.Lock()
        self.done: OrderedDict[str, tuple[str, asyncio.Future]] = OrderedDict()  # request_id -> (body hash, result)

    def _auth_error(self, request: Request) -> JSONResponse | None:
        """None when the request carries the bearer token (compared in constant time), else the 401 to return."""
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.settings.api_token.get_secret_value()}".encode()):
            return None
        return _error(401, "missing or wrong bearer token: send 'Authorization: Bearer $FARM_API_TOKEN'")

    @api.post("/v1/rollouts", response_model=P.RolloutResponse, responses={409: {"model": P.ErrorResponse}, 422: {"model": P.ErrorResponse}, 429: {"model": P.ErrorResponse}})
    async def rollouts(self, req: P.RolloutRequest):
        """Generate `n` samples for each prompt and score them; one group per prompt, in order.

        With a `request_id`, a repeat of the same request (also one still running) gets the first
        result back and generates nothing; the same id with a different body gets 409.
        """
        if req.request_id is None:
            return await self._rollouts(req)
        fingerprint = hashlib.sha256(req.model_dump_json(exclude={"request_id"}).encode()).hexdigest()
        if req.request_id in self.done:
            seen, result = self.done[req.request_id]
            if seen != fingerprint:
                return _error(409, f"request_id {req.request_id!r} was used for a different request: use a new id")
            metrics.REPLAYS.inc()
            return await asyncio.shield(result)
        result = asyncio.get_running_loop().create_future()
        self.done[req.request_id] = (fingerprint, result)
        while len(self.done) > self.settings.idempotency_cache_size:
            self.done.popitem(last=False)
        try:
            response = await self._rollouts(req)
        except BaseException as e:
            self.done.pop(req.request_id, None)  # a failure is not remembered: a retry generates again
            if isinstance(e, asyncio.CancelledError):
                result.cancel()
            else:
                result.set_exception(e)
                result.exception()  # retrieved, even if nobody else waits
            raise
        if not isinstance(response, P.RolloutResponse):
            self.done.pop(req.request_id, None)
        result.set_result(response)
        return response

    async def _rollouts(self, req: P.RolloutRequest):
        if req.reward is not None and req.reward not in REWARDS.names():  # registered names only: no imports from requests
            return _invalid([{"field": "reward", "message": f"unknown reward {req.reward!r}; valid names: {', '.join(REWARDS.names())} (add your own with FARM_PLUGINS)"}])
        if self.vocab is None:
            self.vocab = await self.engine.vocab_size.remote()
        bad = [{"field": f"prompts.{i}.token_ids", "message": f"token ids must be in [0, {self.vocab}): the model's vocabulary"}
               for i, p in enumerate(req.prompts) if p.token_ids and not all(0 <= t < self.vocab for t in p.token_ids)]
        if bad:
            return _invalid(bad)
        chunks = _split(req.prompts, self.settings.replicas)  # spread groups over replicas; a group stays together
        try:
            parts = await asyncio.gather(*[self.engine.rollout.remote(c, req.n, _chunk_params(req.sampling_params, i), req.reward) for i, c in enumerate(chunks)])
        except BackPressureError:
            return JSONResponse(status_code=429, headers={"Retry-After": "1"},
                                content=P.ErrorResponse(error="engine queues are full (FARM_ENGINE_MAX_QUEUED_REQUESTS): retry after 1 s").model_dump())
        groups = [g for part in parts for g in part]
        metrics.GROUPS.inc(len(groups))
        metrics.ZERO_VAR.inc(sum(g.zero_variance for g in groups))
        metrics.SAMPLES.inc(len(groups) * req.n)
        metrics.TOKENS.inc(sum(len(s.token_ids) for g in groups for s in g.samples))
        return P.RolloutResponse(groups=groups)

    @api.post("/v1/completions", responses={422: {"model": P.ErrorResponse}})
    async def completions(self, req: P.CompletionRequest):
        """OpenAI-compatible text completion by the current policy (for lm-eval and similar tools)."""
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        return await self._openai("text_completion", prompts, req.n, openai_compat.sampling(req.max_tokens, req.temperature, req.top_p, req.seed), req.stop)

    @api.post("/v1/chat/completions", responses={422: {"model": P.ErrorResponse}})
    async def chat_completions(self, req: P.ChatCompletionRequest):
        """OpenAI-compatible chat completion; the messages go through the model's chat template."""
        text = await self.engine.render_chat.remote([m.model_dump() for m in req.messages])
        if text is None:
            return _error(422, "the served model has no chat template: use /v1/completions", [{"field": "messages", "message": "no chat template"}])
        params = openai_compat.sampling(req.max_completion_tokens or req.max_tokens or 256, req.temperature, req.top_p, req.seed)
        return await self._openai("chat.completion", [text], req.n, params, req.stop)

    async def _openai(self, kind: str, prompts: list[str], n: int, params: P.SamplingParams, stop):
        try:
            rollout = P.RolloutRequest(prompts=[P.Prompt(text=p) for p in prompts], n=n, sampling_params=params)
        except ValidationError as e:
            return _invalid([{"field": "prompt", "message": err["msg"]} for err in e.errors()])
        result = await self._rollouts(rollout)
        if not isinstance(result, P.RolloutResponse):
            return result
        return openai_compat.response(kind, os.path.basename(self.settings.model.rstrip("/")), result.groups, stop, chat=kind == "chat.completion")

    @api.post("/v1/weights", response_model=P.WeightsPushResponse, responses={401: {"model": P.ErrorResponse}, 409: {"model": P.ErrorResponse}, 413: {"model": P.ErrorResponse}, 422: {"model": P.ErrorResponse}})
    async def push_weights(self, request: Request, version: int):
        """Upload a safetensors state dict (raw body) as `version`; returns once every replica serves it."""
        if denied := self._auth_error(request):
            return denied
        if int(request.headers.get("content-length") or 0) > self.settings.max_weights_bytes:
            return _error(413, f"upload larger than FARM_MAX_WEIGHTS_BYTES={self.settings.max_weights_bytes}")
        data = await request.body()
        if len(data) > self.settings.max_weights_bytes:
            return _error(413, f"upload larger than FARM_MAX_WEIGHTS_BYTES={self.settings.max_weights_bytes}")
        async with self.push_lock:
            start = time.perf_counter()
            current = max(v for _, v in await self.engine.broadcast("weight_version").results_async(timeout_s=30))
            if version <= current:
                return _error(409, f"version {version} is not newer than the served version {current}: push version {current + 1} or higher")
            if self.spec is None:
                self.spec = await self.engine.weight_spec.remote()
            try:
                tensors = check_upload(data, self.spec)
            except WeightsError as e:
                return _error(422, "weights refused; the old version keeps serving", [{"field": "body", "message": m} for m in e.problems])
            try:
                results = await self.engine.broadcast("update_weights", [ray.put(data)], version).results_async(
                    timeout_s=self.settings.weight_sync_timeout_s, return_exceptions=True)
            except TimeoutError:
                return _error(504, f"replicas did not load version {version} within FARM_WEIGHT_SYNC_TIMEOUT_S={self.settings.weight_sync_timeout_s}")
            failed = [str(r).strip().splitlines()[-1] if isinstance(r, Exception) else f"replica serves version {r}" for r in results if r != version]
            if failed:
                log.error(json.dumps({"event": "weight_sync_failed", "version": version, "errors": [str(f) for f in failed]}))
                return _error(500, f"{len(failed)} of {len(results)} replicas failed to load version {version}", [{"field": "replica", "message": f} for f in failed])
            seconds = time.perf_counter() - start
        metrics.VERSION.set(version)
        metrics.SYNC_SECONDS.observe(seconds)
        metrics.SYNC_BYTES.inc(len(data))
        log.info(json.dumps({"event": "weights_pushed", "version": version, "bytes": len(data), "seconds": round(seconds, 3)}))
        return P.WeightsPushResponse(version=version, tensors=tensors, bytes=len(data), seconds=seconds)

    @api.get("/v1/weights/version", response_model=P.WeightsVersion)
    async def weights_version(self):
        """The version every replica serves, and each replica's own."""
        replicas = dict(await self.engine.broadcast("weight_version").results_async(timeout_s=30))
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
        """Prometheus metrics."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def build_app(settings: ServiceSettings):
    """The Serve application for these settings."""
    engine = serve.deployment(
        EngineServer, name="engine", num_replicas=settings.replicas, max_ongoing_requests=settings.engine_max_ongoing_requests,
        max_queued_requests=settings.engine_max_queued_requests,
        ray_actor_options={"num_cpus": settings.engine_num_cpus},
        deployment_actors=[DeploymentActorConfig(name="weights", actor_class=WeightStore)],
    )
    ingress = serve.deployment(Ingress, name="ingress", max_ongoing_requests=settings.ingress_max_ongoing_requests, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(settings), settings)
