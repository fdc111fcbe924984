"""Tinker's sampling API on the farm's objects: the unmodified `tinker` SDK (0.38.0) samples from a farm adapter
(docs/tenants.md, "Tinker"). The routes are rollout_farm/services/api/tinker.py; the requests,
rollout_farm/services/protocol/tinker.py.

A SamplingClient's calls, in order:
  create_session           a session: a namespace for sampling sessions, owned by the caller's key
  create_sampling_session  its policy, checked now: `model_path` names an adapter, 'tinker://<name>@v<N>', or
                           'tinker://<name>' (its newest resident version now, which the sampling session keeps);
                           `base_model` alone, the base. Unknown, another tenant's or not resident: a 404
  asample                  checked at once (a 422 naming the field); the samples are a rollout (Rollouts.answer,
                           with its checks and the adapter's digest backstop) run in the background here; the answer
                           names a future
  retrieve_future          held up to LONG_POLL_S while the sample runs (then `try_again`); its protobuf result
compute_logprobs is a sample with prompt_logprobs: a replica's score_ids verb scores the prompt under the adapter.

Refusals are 4xx the SDK does not retry: never 409 or 5xx for a request that will not succeed later (the SDK retries
those for minutes). A farm 409 (a version outside the resident window) is a 404 here.

Redis keys (farm:<app>:tinker:...), shared by every ingress replica, so that any one of them answers:
  session:<id>        its owner ("" for the admin); expires SESSION_TTL_S after its last heartbeat
  sampler:<id>        P.tinker.Sampler and its owner; expires SESSION_TTL_S after its last use
  future:<id>         a running sample's lease, renewed by the replica running it
  result:<id>         its outcome, kept RESULT_TTL_S: the protobuf (base64), or the error
A future with neither (its replica died, or it failed for a passing reason: queues full, a pause, a replica lost)
answers 410, and the SDK submits the sample again.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import json
import logging
import os
import uuid
from typing import TYPE_CHECKING

from pydantic import ValidationError
from redis.asyncio import Redis

from rollout_farm.services import protocol as P
from rollout_farm.services.compat import tinker_proto
from rollout_farm.services.errors import (
    Conflict,
    Invalid,
    NotFound,
    ServiceError,
    Unavailable,
    as_service_error,
    described,
)
from rollout_farm.services.protocol import tinker as T
from rollout_farm.services.tenants.registry import Principal

if TYPE_CHECKING:
    from rollout_farm.services.adapters.registry import AdapterRegistry
    from rollout_farm.services.replica.handle import Replicas
    from rollout_farm.services.rollout.fanout import Fanout
    from rollout_farm.services.rollout.request_checks import RequestChecks
    from rollout_farm.services.rollout.rollouts import Rollouts

log = logging.getLogger("farm.service")

SESSION_TTL_S = 7 * 24 * 3600  # an idle session or sampling session is forgotten after this
LEASE_S = 15  # a running sample's lease; its replica renews it every LEASE_S / 3
RESULT_TTL_S = 900  # a sample's outcome is kept this long (the SDK reads it once, or again after a dropped answer)
LONG_POLL_S = 25.0  # retrieve_future holds a pending future this long (the SDK's read timeout is 45 s)
POLL_S = 0.05
DEFAULT_MAX_TOKENS = P.SamplingParams.model_fields["max_new_tokens"].default
RESUBMIT = (429, 503)  # a sample failing with these is resubmitted by the SDK (410): the cause passes
UNKNOWN_FIELD = "not a field rollout-farm serves in this Tinker request: remove it (docs/tenants.md, Tinker)"


class Gone(ServiceError):
    """410: the future is unknown, expired, or failed for a passing reason; the SDK submits the sample again."""

    status = 410


def parsed(model: type[P.RequestModel], body: dict):
    """The request `model` from a JSON body; a 422 naming each bad field (Tinker's names)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        detail = [
            {
                "field": ".".join(str(x) for x in err["loc"]) or "body",
                "message": UNKNOWN_FIELD
                if err["type"] == "extra_forbidden"
                else err["msg"].removeprefix("Value error, "),
            }
            for err in e.errors()
        ]
        raise Invalid(detail, f"invalid Tinker request ({model.__name__}): fix the named fields") from None


def not_served(path: str) -> NotFound:
    """A Tinker call rollout-farm does not serve (training, weights, checkpoints): a 404 the SDK does not retry."""
    return NotFound(
        f"/api/v1/{path} is not served: rollout-farm serves Tinker's sampling calls only "
        "(ServiceClient.create_sampling_client). Training, weights and checkpoint calls are not: train elsewhere, "
        "push the LoRA adapter (POST /v1/adapters/{name}) and sample from 'tinker://<name>'",
        [{"field": "path", "message": "not a sampling call"}],
    )


def farm_params(sp: T.SamplingParams) -> P.SamplingParams:
    """Tinker's sampling params as the farm's. `stop`: None keeps EOS; strings or token ids replace it (EOS stops
    only if listed), and [] never stops before max_tokens."""
    stop = [sp.stop] if isinstance(sp.stop, str) else sp.stop
    return P.SamplingParams(
        max_new_tokens=sp.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        seed=sp.seed,
        stop=[s for s in stop or [] if isinstance(s, str)],
        stop_token_ids=[s for s in stop or [] if isinstance(s, int)],
        ignore_eos=stop is not None,
    )


class TinkerCompat:
    def __init__(
        self,
        rollouts: Rollouts,
        fanout: Fanout,
        checks: RequestChecks,
        replicas: Replicas,
        adapters: AdapterRegistry,
        r: Redis,
        prefix: str,
        model: str,
    ):
        self.rollouts, self.fanout, self.checks, self.replicas = rollouts, fanout, checks, replicas
        self.adapters, self.r, self.prefix = adapters, r, f"{prefix}:tinker"
        self.model, self.model_name = model, os.path.basename(model.rstrip("/"))
        self.running: set[asyncio.Task] = set()

    def key(self, kind: str, name: str) -> str:
        return f"{self.prefix}:{kind}:{name}"

    # sessions and sampling sessions -------------------------------------------------------------------------
    async def create_session(self, who: Principal) -> T.CreateSessionResponse:
        session_id = f"sess-{uuid.uuid4().hex}"
        await self.r.set(self.key("session", session_id), owner(who), ex=SESSION_TTL_S)
        return T.CreateSessionResponse(session_id=session_id)

    async def heartbeat(self, body: dict, who: Principal) -> dict:
        req = parsed(T.SessionRef, body)
        await self._session(req.session_id, who)
        return {"type": "session_heartbeat"}

    async def finish(self, session_id: str, who: Principal) -> dict:
        """The session is forgotten (its sampling sessions expire by themselves); an unknown one is no error."""
        key = self.key("session", session_id)
        if await self.r.get(key) == owner(who):
            await self.r.delete(key)
        return {}

    async def _session(self, session_id: str, who: Principal) -> None:
        """404 unless the caller's session exists; it lives SESSION_TTL_S longer."""
        key = self.key("session", session_id)
        held = await self.r.get(key)
        if held is None or not may_use(who, held):
            raise NotFound(
                f"no session {session_id!r} for this key (it expired, or another key made it): make a new "
                "ServiceClient",
                [{"field": "session_id", "message": "unknown"}],
            )
        await self.r.expire(key, SESSION_TTL_S)

    async def create_sampling_session(self, body: dict, who: Principal) -> T.CreateSamplingSessionResponse:
        req = parsed(T.CreateSamplingSession, body)
        await self._session(req.session_id, who)
        if req.model_path is None and req.base_model is None:
            raise Invalid([{"field": "model_path", "message": "give model_path (an adapter) or base_model"}])
        if req.base_model is not None and req.base_model not in (self.model, self.model_name):
            raise Invalid(
                [{"field": "base_model", "message": f"the farm serves {self.model!r}, not {req.base_model!r}"}]
            )
        model_path = await self._pinned(req.model_path, who) if req.model_path else None
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        sampler = T.Sampler(sampler_id=sampler_id, base_model=self.model, model_path=model_path)
        record = json.dumps({"owner": owner(who), **sampler.model_dump()})
        await self.r.set(self.key("sampler", sampler_id), record, ex=SESSION_TTL_S)
        return T.CreateSamplingSessionResponse(sampling_session_id=sampler_id)

    async def _pinned(self, model_path: str, who: Principal) -> str:
        """'tinker://<name>@v<N>' of the resident version `model_path` names (the newest, without @v<N>); 404 for an
        adapter the caller may not use or that is not resident."""
        ref = adapter_of(model_path)
        if await self.adapters.visible(ref.name, who) is None:
            raise NotFound(
                f"adapter {ref.name!r} is unknown: push it first (POST /v1/adapters/{ref.name}); GET /v1/adapters "
                "lists those this key may use",
                [{"field": "model_path", "message": "no such adapter"}],
            )
        version = await resident(self.adapters.resolve(ref))
        return f"{T.TINKER_SCHEME}{ref.name}@v{version.version}"

    async def sampler(self, sampler_id: str, who: Principal) -> T.Sampler:
        """The caller's sampling session; it lives SESSION_TTL_S longer. Another key's is unknown (404)."""
        key = self.key("sampler", sampler_id)
        raw = await self.r.get(key)
        record = json.loads(raw) if raw else None
        if record is None or not may_use(who, record.pop("owner")):
            raise NotFound(
                f"no sampling session {sampler_id!r} for this key (it expired, or another key made it): create a "
                "new sampling client",
                [{"field": "sampling_session_id", "message": "unknown"}],
            )
        await self.r.expire(key, SESSION_TTL_S)
        return T.Sampler(**record)

    async def capabilities(self) -> T.Capabilities:
        context = await self.checks.context_length()
        return T.Capabilities(supported_models=[T.ModelCapability(model_name=self.model, max_context_length=context)])

    # samples ------------------------------------------------------------------------------------------------
    async def asample(self, body: dict, who: Principal, admit=None) -> T.FutureHandle:
        """Check the request, start its rollout in the background (once per sampling session and seq_id: a
        resubmission finds the same future) and name the future. `admit(samples)`, when given, is the caller's
        tenant admission (Tenants.admitted: a 429 naming the tenant now, before anything runs); its samples count in
        flight until the sample ends, and its generated tokens are taken then."""
        req = parsed(T.SampleRequest, body)
        sampler = await self.sampler(req.sampling_session_id, who)
        request_id = f"{req.sampling_session_id}:{req.seq_id}"
        handle = T.FutureHandle(
            request_id=request_id, sample_sequence_ids=[f"{request_id}:{i}" for i in range(req.num_samples)]
        )
        lease, result = self.key("future", request_id), self.key("result", request_id)
        if await self.r.exists(lease, result):
            return handle
        rollout, prompt = await self._rollout(req, sampler)
        admission = contextlib.AsyncExitStack()
        took = await admission.enter_async_context(admit(req.num_samples)) if admit else None
        try:
            if not await self.r.set(lease, owner(who), nx=True, ex=LEASE_S):
                await admission.aclose()  # another submission of it runs
                return handle
            scored = (len(prompt), req.prompt_logprobs_last_n) if req.prompt_logprobs else None
            run = self._run(lease, result, owner(who), rollout, scored, admission, took)
        except BaseException:
            await admission.aclose()
            raise
        task = contextvars.Context().run(asyncio.create_task, run)  # its own context: the engine calls outlive ours
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        return handle

    async def _rollout(self, req: T.SampleRequest, sampler: T.Sampler) -> tuple[P.RolloutRequest, list[int]]:
        """The request as a rollout, checked (token ids, context, the adapter still resident); 422 or 404 now."""
        prompt = [t for chunk in req.prompt.chunks for t in chunk.tokens]
        if not prompt:
            raise Invalid([{"field": "prompt.chunks", "message": "no tokens: give at least one token id"}])
        last_n = req.prompt_logprobs_last_n
        if last_n is not None and (not req.prompt_logprobs or last_n > len(prompt) - 1):
            raise Invalid(
                [
                    {
                        "field": "prompt_logprobs_last_n",
                        "message": f"needs prompt_logprobs, and must be 1..{len(prompt) - 1} (the prompt's length - 1)",
                    }
                ]
            )
        adapter = adapter_of(sampler.model_path) if sampler.model_path else None
        rollout = P.RolloutRequest(
            prompts=[P.Prompt(token_ids=prompt)],
            n=req.num_samples,
            sampling_params=farm_params(req.sampling_params),
            adapter=adapter,
        )
        try:
            await self.checks.tokens(rollout.prompts)
            await self.checks.fits(
                rollout.prompts, rollout.sampling_params.max_new_tokens, "sampling_params.max_tokens"
            )
        except Invalid as e:
            raise Invalid([{**d, "field": d["field"].replace("prompts.0", "prompt")} for d in e.detail], e.message)
        await resident(self.fanout.resolve(rollout))
        return rollout, prompt

    async def _run(
        self,
        lease: str,
        result: str,
        who: str,
        rollout: P.RolloutRequest,
        scored: tuple[int, int | None] | None,
        admission: contextlib.AsyncExitStack,
        took=None,
    ) -> None:
        """The sample, and its outcome recorded for retrieve_future (a passing failure leaves none: 410); then the
        admission ends (`took`: the tokens it generated)."""
        renewing = asyncio.create_task(self._renew(lease))
        try:
            async with admission:
                body = await self._sample(rollout, scored, took)
            record = {"state": "done", "body": base64.b64encode(body).decode()}
        except Exception as e:
            error = as_service_error(e)
            if error.status >= 500 and error.status not in RESUBMIT:
                log.warning("tinker_sample_failed", extra={"error": described(e), "status": error.status})
            record = None if error.status in RESUBMIT else failure(error)
        finally:
            renewing.cancel()
        try:
            async with self.r.pipeline(transaction=True) as pipe:
                if record is not None:
                    pipe.set(result, json.dumps({"owner": who, **record}), ex=RESULT_TTL_S)
                await pipe.delete(lease).execute()
        except Exception as e:  # Redis away: the lease lapses, and the SDK submits the sample again
            log.warning("tinker_result_lost", extra={"error": described(e)})

    async def _renew(self, lease: str) -> None:
        while True:
            await asyncio.sleep(LEASE_S / 3)
            try:
                await self.r.expire(lease, LEASE_S)
            except Exception as e:
                log.warning("tinker_lease_renewal_failed", extra={"error": described(e)})

    async def _sample(self, rollout: P.RolloutRequest, scored: tuple[int, int | None] | None, took=None) -> bytes:
        """The rollout's samples (and the prompt's logprobs) as the protobuf SampleResponse (`took`: its tokens)."""
        (group,) = (await self.rollouts.answer(rollout)).groups
        if took is not None:
            took(sum(len(s.token_ids) for s in group.samples))
        sequences = []
        for i, s in enumerate(group.samples):
            if s.finish_reason == "abort":  # cut by a weight commit, after the replica's own reruns
                raise Unavailable(f"sample {i} was cut short by a weight commit: submit it again")
            if s.finish_reason not in tinker_proto.STOP_REASONS:
                raise ServiceError(f"sample {i} failed in the engine ({s.finish_reason}); see the service log")
            sequences.append((s.token_ids, s.logprobs, s.finish_reason))
        prompt_logprobs = await self._prompt_logprobs(rollout, *scored) if scored else None
        return tinker_proto.sample_response(sequences, prompt_logprobs)

    async def _prompt_logprobs(self, rollout: P.RolloutRequest, length: int, last_n: int | None) -> list:
        """Each prompt token's logprob under the rollout's policy (None for the first), the last `last_n` only."""
        ids = rollout.prompts[0].token_ids
        (scored,) = await self.replicas.call("score_ids", [ids], 0, rollout._resolved_adapter)
        logprobs = scored["logprobs"]
        return [None] * (length - last_n) + logprobs[length - last_n :] if last_n else logprobs

    async def retrieve(self, body: dict, who: Principal) -> bytes | T.TryAgain | T.RequestFailed:
        """The future's protobuf result or its error, waiting up to LONG_POLL_S while it runs; 410 when it is gone
        (the SDK submits the sample again), 404 for another key's."""
        req = parsed(T.FutureRef, body)
        lease, result = self.key("future", req.request_id), self.key("result", req.request_id)
        deadline = asyncio.get_running_loop().time() + LONG_POLL_S
        while True:
            running, raw = await self.r.mget(lease, result)  # one read: the outcome is written as the lease goes
            held = json.loads(raw)["owner"] if raw else running
            if held is None:
                raise Gone(f"no sample {req.request_id!r} here (expired, or it must run again): submit it again")
            if not may_use(who, held):
                raise NotFound(f"no sample {req.request_id!r} for this key", [{"field": "request_id", "message": ""}])
            if raw:
                record = json.loads(raw)
                if record["state"] == "done":
                    return base64.b64decode(record["body"])
                return T.RequestFailed(error=record["error"], category=record["category"])
            if asyncio.get_running_loop().time() >= deadline:
                return T.TryAgain(request_id=req.request_id)
            await asyncio.sleep(POLL_S)


def owner(who: Principal) -> str:
    """Who owns what a key makes: its tenant, or "" for the admin."""
    return "" if who.admin else who.tenant or ""


def may_use(who: Principal, held: str) -> bool:
    return who.admin or held == owner(who)


def adapter_of(model_path: str) -> P.AdapterRef:
    """'tinker://<name>@v<N>' (exact) or 'tinker://<name>' (newest resident) as an AdapterRef."""
    return P.AdapterRef.parse(model_path.removeprefix(T.TINKER_SCHEME))


async def resident(resolving):
    """An adapter resolution, its farm 409 (a version outside the resident window) as a 404: the SDK retries a 409
    for five minutes, and an evicted version does not come back."""
    try:
        return await resolving
    except Conflict as e:
        detail = [{**d, "field": "model_path"} for d in e.detail]
        raise NotFound(f"{e.message}: create a sampling client for a resident version", detail) from None


def failure(error: ServiceError) -> dict:
    """A failed sample's record: the error with its fields, and whose fault ('user' for a 4xx)."""
    fields = "; ".join(f"{d.get('field')}: {d.get('message')}" for d in error.detail)
    message = f"{error.message} ({fields})" if fields else error.message
    return {"state": "failed", "error": message, "category": "user" if error.status < 500 else "server"}
