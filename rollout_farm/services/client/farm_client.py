"""A typed Python client for the rollout service, for our trainer and for other frameworks (verl, TRL, ...).

One implementation, two faces. `_Api` defines every call of the API once: each method describes its request as a
`_Call` (method, path, body, the model it answers, whether it is safe to send twice) and returns `self._send(call)`.
`FarmClient._send` sends it with httpx.Client and returns the answer; `AsyncFarmClient._send` is `async def` and
sends it with httpx.AsyncClient, so there the same method is awaited. Both run the call under the one retry policy
of `_Api._policy` (tenacity); only the sleep differs. `rollouts_stream` alone has two bodies, a generator and an
async generator, since Python has no generator that is both; what they do with each line lives once, in `_Stream`.

Connection failures, 429 and 500-504 (a 500 is the front's, never the service's) are retried with capped exponential
backoff and full jitter, or after the answer's Retry-After (429 and 503, in seconds, at most max(max_backoff_s, 60)).
A call that must not run twice (a queue pull, adding or removing a source, adding prompts) is retried only where the
service cannot have acted on it: a 429, a connection that was never made, or the plain-text 404 of a Serve front that
has just started and has no routes yet. Any other 4xx is raised at once as FarmError, carrying the service's
field-by-field detail.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import httpx
import tenacity

from rollout_farm.services import protocol as P
from rollout_farm.services.client.calls import FarmError, _aslices, _Call, _rollout_body, _slices, _Stream
from rollout_farm.services.protocol import episodes as E

__all__ = ["AsyncFarmClient", "FarmClient", "FarmError"]
CONTROL_ACTIONS = ("pause", "resume", "abort")


class _Api:
    """Every call of the API, defined once. A subclass sets `_http` (the httpx client class), `_sleep` and `_send`."""

    _http: type
    _sleep: Callable[[float], Any]

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 600.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
    ):
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = self._http(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def _policy(self, retryable: Callable[[BaseException], bool]) -> dict:
        """tenacity's arguments: up to `retries` more attempts, each after the answer's Retry-After (capped),
        or else after a capped exponential backoff with full jitter."""
        backoff = tenacity.wait_random_exponential(multiplier=self.backoff_s, max=self.max_backoff_s)
        cap = max(self.max_backoff_s, 60.0)

        def wait(state) -> float:
            after = getattr(state.outcome.exception(), "retry_after", None)
            return backoff(state) if after is None else min(after, cap)

        stop, retry = tenacity.stop_after_attempt(self.retries + 1), tenacity.retry_if_exception(retryable)
        return dict(stop=stop, wait=wait, retry=retry, reraise=True, sleep=self._sleep)

    def rollouts(self, req: P.RolloutRequest) -> P.RolloutResponse:
        return self._send(_Call("POST", "/v1/rollouts", P.RolloutResponse, json=_rollout_body(req)))

    def episodes(self, req: E.EpisodeRequest) -> E.EpisodeResponse:
        """Groups of multi-turn episodes run in the farm against an environment (POST /v1/episodes)."""
        return self._send(_Call("POST", "/v1/episodes", E.EpisodeResponse, json=req.model_dump(mode="json")))

    def cancel(self, request_id: str) -> P.CancelResponse:
        """Cancel a running rollout; cancelled=False when none with this id runs."""
        return self._send(_Call("DELETE", f"/v1/rollouts/{request_id}", P.CancelResponse))

    def samplers(self) -> dict[str, str]:
        return self._send(_Call("GET", "/v1/samplers", None))

    def report_policy_stats(self, stats: P.PolicyStats) -> P.PolicyStats:
        """Tell the service's samplers the policy's KL, reward variance and step (needs the token); left-out fields
        keep their value."""
        return self._send(_Call("POST", "/v1/policy_stats", P.PolicyStats, json=stats.model_dump(exclude_unset=True)))

    def push_weights(
        self, safetensors_bytes: bytes, version: int, policy: P.InFlightPolicy = "finish", force: bool = False
    ) -> P.WeightsPushResponse:
        """Upload a safetensors state dict as `version`, with its SHA-256; returns once every replica serves it.
        `force`: even while LoRA adapters made on the served base are resident (they are retired first)."""
        data, params = safetensors_bytes, {"version": version, "policy": policy, "force": force}
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(data))}
        headers["x-content-sha256"] = hashlib.sha256(data).hexdigest()
        call = _Call("POST", "/v1/weights", P.WeightsPushResponse, upload=data, params=params, headers=headers)
        return self._send(call)

    def push_pieces(
        self, pieces: Callable[[], Iterable], size: int, version: int, policy: P.InFlightPolicy = "finish"
    ) -> P.WeightsPushResponse:
        """Upload a body made of pieces (bytes-like; `pieces()` gives them afresh for each attempt) of `size` bytes in
        all, as `version`: what rollout_farm/services/weights/pusher.py's WeightPusher sends (buckets straight from the
        tensors' memory, with a manifest of per-tensor checksums). For a state dict, use WeightPusher.push."""
        params = {"version": version, "policy": policy}
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        return self._send(
            _Call("POST", "/v1/weights", P.WeightsPushResponse, upload=pieces, params=params, headers=headers)
        )

    def push_weights_path(
        self,
        path: str,
        version: int,
        policy: P.InFlightPolicy = "finish",
        force: bool = False,
        probe: dict | None = None,
    ) -> P.WeightsPushResponse:
        """Load a folder of safetensors files that every replica can read, as `version` (`force`: as push_weights;
        `probe`: compute_probe's, scored by every replica on the staged weights)."""
        body = P.WeightsFromPath(path=str(path), version=version, policy=policy, force=force, probe=probe).model_dump()
        return self._send(_Call("POST", "/v1/weights/path", P.WeightsPushResponse, json=body))

    def weights_version(self) -> P.WeightsVersion:
        return self._send(_Call("GET", "/v1/weights/version", P.WeightsVersion))

    # LoRA adapters and tenants (docs/tenants.md) -------------------------------------------------------------
    def push_adapter(self, name: str, folder: str, version: int, probe: dict | None = None) -> P.AdapterPushResponse:
        """Upload a peft adapter folder (adapter_config.json, adapter_model.safetensors) as `name@v{version}`; the
        answer's digest is the one every sample from it carries. `probe`: sequences and the logprobs the pusher
        computed with this adapter (rollout_farm/services/weights/pusher.py's compute_probe), checked on every
        replica."""
        from rollout_farm.services.client.peft_files import upload_body

        data = upload_body(folder, probe)
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(data))}
        params = {"version": version}
        return self._send(
            _Call("POST", f"/v1/adapters/{name}", P.AdapterPushResponse, upload=data, params=params, headers=headers)
        )

    def push_adapter_path(self, name: str, path: str, version: int, probe: dict | None = None) -> P.AdapterPushResponse:
        """Push a peft adapter folder every replica can read, as `name@v{version}` (`probe`: as push_adapter)."""
        body = P.AdapterFromPath(path=str(path), version=version, probe=probe).model_dump()
        return self._send(_Call("POST", f"/v1/adapters/{name}/path", P.AdapterPushResponse, json=body))

    def adapters(self) -> P.AdapterList:
        return self._send(_Call("GET", "/v1/adapters", P.AdapterList))

    def adapter(self, name: str) -> P.AdapterInfo:
        return self._send(_Call("GET", f"/v1/adapters/{name}", P.AdapterInfo))

    def retire_adapter(self, name: str) -> P.AdapterInfo:
        return self._send(_Call("DELETE", f"/v1/adapters/{name}", P.AdapterInfo))

    def create_tenant(self, tenant: str) -> P.TenantToken:
        """A new tenant, or another token for one (the admin token): the token is in this answer only."""
        return self._send(_Call("POST", f"/v1/tenants/{tenant}", P.TenantToken))

    def tenants(self) -> P.TenantList:
        return self._send(_Call("GET", "/v1/tenants", P.TenantList))

    def revoke_tenant(self, tenant: str) -> P.TenantInfo:
        return self._send(_Call("DELETE", f"/v1/tenants/{tenant}", P.TenantInfo))

    def control(self, action: str) -> P.ControlResponse:
        """'pause', 'resume' or 'abort' on every replica (needs the token). Any other action is a ValueError, unsent."""
        if action not in CONTROL_ACTIONS:
            raise ValueError(f"unknown control action {action!r}: use one of {', '.join(CONTROL_ACTIONS)}")
        return self._send(_Call("POST", f"/v1/{action}", P.ControlResponse))

    def health(self) -> P.Health:
        return self._send(_Call("GET", "/healthz", P.Health))

    def queue_add_source(self, spec: P.QueueSource) -> P.QueueSourceState:
        body = spec.model_dump(exclude_none=True)
        return self._send(_Call("POST", "/v1/queue/sources", P.QueueSourceState, replay=False, json=body))

    def queue_sources(self) -> list[P.QueueSourceState]:
        return self._send(_Call("GET", "/v1/queue/sources", P.QueueSourceState))

    def queue_remove_source(self, name: str) -> P.QueueSourceState:
        return self._send(_Call("DELETE", f"/v1/queue/sources/{name}", P.QueueSourceState, replay=False))

    def queue_add_prompts(self, name: str, prompts: list[P.Prompt], batch_id: str | None = None) -> P.QueueSourceState:
        """Add prompts to a source; with a batch_id the addition is idempotent (and so retried on failures)."""
        body, path = P.QueuePrompts(prompts=prompts).model_dump(exclude_none=True), f"/v1/queue/sources/{name}/prompts"
        params = {"batch_id": batch_id} if batch_id else None
        return self._send(
            _Call("POST", path, P.QueueSourceState, replay=batch_id is not None, json=body, params=params)
        )

    def queue_upload_jsonl(self, name: str, data: bytes) -> P.QueueSourceState:
        """Add prompts from JSONL bytes, one Prompt object per line."""
        headers = {"Content-Type": "application/x-ndjson"}
        path = f"/v1/queue/sources/{name}/prompts"
        return self._send(_Call("POST", path, P.QueueSourceState, replay=False, content=data, headers=headers))

    def queue_pull(self, req: P.PullRequest) -> P.PullResponse:
        """Lease groups. Not idempotent, so retried only on 429 and refused connections: a pull whose answer
        was lost leased its groups anyway; they are delivered again (same item_id) when the lease runs out."""
        body = req.model_dump(exclude_none=True)
        return self._send(_Call("POST", "/v1/queue/pull", P.PullResponse, replay=False, json=body))

    def queue_ack(self, item_ids: list[str]) -> P.AckResponse:
        """Settle used groups; acking twice is harmless, so this is retried like a read."""
        return self._send(_Call("POST", "/v1/queue/ack", P.AckResponse, json={"item_ids": list(item_ids)}))

    def wait_ready(self, timeout_s: float = 300.0) -> P.Health:
        """Poll /healthz every 0.5 s until the service generates a token, or raise TimeoutError."""

        def timed_out(state) -> None:
            raise TimeoutError(f"service at {self.http.base_url} not healthy after {timeout_s:.0f}s")

        stop, wait = tenacity.stop_after_delay(timeout_s), tenacity.wait_fixed(0.5)
        retry = tenacity.retry_if_exception_type((httpx.HTTPError, FarmError, ValueError))
        policy = dict(stop=stop, wait=wait, retry=retry, retry_error_callback=timed_out, sleep=self._sleep)
        return self._send(_Call("GET", "/healthz", P.Health), policy)


class FarmClient(_Api):
    """The service's calls for plain Python code (httpx.Client); each method returns the answer."""

    _http = httpx.Client
    _sleep = staticmethod(time.sleep)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> FarmClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, call: _Call, policy: dict | None = None) -> Any:
        return tenacity.Retrying(**(policy or self._policy(call.retryable)))(self._attempt, call)

    def _attempt(self, call: _Call) -> Any:
        return call.answer(self.http.request(call.method, call.path, **call.request_kw(_slices)))

    def rollouts_stream(self, req: P.RolloutRequest) -> Iterator[P.GroupEvent]:
        """Each group as it finishes (with its prompt's index); FarmError if the rollout fails midway. Stopping early
        closes the connection, which cancels the rollout. Retried only until the first line arrives: the request_id
        makes the retry a replay, not a second rollout."""
        s = _Stream(req)
        for attempt in tenacity.Retrying(**self._policy(s.retryable)):
            with attempt, self.http.stream("POST", "/v1/rollouts", json=s.body) as r:
                if r.is_error:
                    r.read()
                s.open(r)
                for text in r.iter_text():
                    yield from s.events(text)
                    if s.done:
                        return
                raise s.cut()


class AsyncFarmClient(_Api):
    """The same calls for asyncio code (httpx.AsyncClient): await each method, `async for` over rollouts_stream."""

    _http = httpx.AsyncClient
    _sleep = staticmethod(asyncio.sleep)

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncFarmClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _send(self, call: _Call, policy: dict | None = None) -> Any:
        return await tenacity.AsyncRetrying(**(policy or self._policy(call.retryable)))(self._attempt, call)

    async def _attempt(self, call: _Call) -> Any:
        return call.answer(await self.http.request(call.method, call.path, **call.request_kw(_aslices)))

    async def rollouts_stream(self, req: P.RolloutRequest) -> AsyncIterator[P.GroupEvent]:
        """See FarmClient.rollouts_stream."""
        s = _Stream(req)
        async for attempt in tenacity.AsyncRetrying(**self._policy(s.retryable)):
            with attempt:
                async with self.http.stream("POST", "/v1/rollouts", json=s.body) as r:
                    if r.is_error:
                        await r.aread()
                    s.open(r)
                    async for text in r.aiter_text():
                        for event in s.events(text):
                            yield event
                        if s.done:
                            return
                    raise s.cut()
