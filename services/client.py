"""A typed Python client for the rollout service, for our trainer and for other frameworks (verl, TRL, ...).

Connection failures, 429 and 502-504 are retried with capped exponential backoff and jitter.
A call that must not run twice (a queue pull, adding a source or prompts) is retried only where the
service cannot have acted on it: a 429, or a connection that was never made.
A 4xx is raised at once as FarmError, carrying the service's field-by-field detail.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx

from services import protocol as P

RETRY_STATUS = {429, 502, 503, 504}
CHUNK_BYTES = 8 << 20  # weights go up in slices this big: httpcore copies one big bytes body, slices it sends as they are


class FarmError(RuntimeError):
    def __init__(self, status: int, body: dict | str):
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}: {body}")


def _slices(data: bytes) -> Iterator[memoryview]:
    view = memoryview(data)
    return (view[i:i + CHUNK_BYTES] for i in range(0, len(view), CHUNK_BYTES))


async def _aslices(data: bytes) -> AsyncIterator[memoryview]:
    for s in _slices(data):
        yield s


class _Retrying:
    """What the sync and async clients share: settings, backoff and the reading of a response."""

    def __init__(self, token: str | None, retries: int, backoff_s: float, max_backoff_s: float):
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s

    def _delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2 ** attempt))  # full jitter

    def _accept(self, r: httpx.Response, attempt: int, replay: bool = True) -> bool:
        """True for a success; False to retry; raises FarmError for a final error."""
        if r.status_code < 400:
            return True
        if r.status_code in (RETRY_STATUS if replay else {429}) and attempt < self.retries:
            return False
        try:
            body = r.json()
        except ValueError:
            body = r.text
        raise FarmError(r.status_code, body)

    def _give_up(self, e: httpx.TransportError, attempt: int, replay: bool = True) -> bool:
        """Whether a transport error is final; without replay only a connection never made is retried."""
        return attempt == self.retries or not (replay or isinstance(e, httpx.ConnectError))

    @staticmethod
    def _rollout_body(req: P.RolloutRequest, stream: bool = False) -> dict:
        """The request under a request_id (a fresh one unless given), so that every retry is safe."""
        update = {"stream": stream} if req.request_id else {"stream": stream, "request_id": uuid.uuid4().hex}
        return req.model_copy(update=update).model_dump(exclude_none=True)

    @staticmethod
    def _stream_line(line: str, status: int) -> P.GroupEvent | None:
        """A GroupEvent, or None for the closing line; FarmError when the stream ended with an error."""
        data = json.loads(line)
        if "done" not in data:
            return P.GroupEvent.model_validate(data)
        end = P.StreamEnd.model_validate(data)
        if end.error:
            raise FarmError(end.status or status, P.ErrorResponse(error=end.error).model_dump())
        return None

    @staticmethod
    def _weights_args(data: bytes, version: int, policy: str) -> dict:
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(data)), "x-content-sha256": hashlib.sha256(data).hexdigest()}
        return {"params": {"version": version, "policy": policy}, "headers": headers}

    @staticmethod
    def _jsonl_args(data: bytes) -> dict:
        return {"content": data, "headers": {"Content-Type": "application/x-ndjson"}}


class FarmClient(_Retrying):
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 600.0, retries: int = 4, backoff_s: float = 0.5, max_backoff_s: float = 8.0):
        super().__init__(token, retries, backoff_s, max_backoff_s)
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=self.headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "FarmClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, replay: bool = True, upload: bytes | None = None, **kw) -> httpx.Response:
        """`upload` is sent in slices, a fresh iterator per attempt; replay=False: see the module docstring."""
        for attempt in range(self.retries + 1):
            try:
                if upload is not None:
                    kw["content"] = _slices(upload)
                r = self.http.request(method, path, **kw)
                if self._accept(r, attempt, replay):
                    return r
            except httpx.TransportError as e:
                if self._give_up(e, attempt, replay):
                    raise
            time.sleep(self._delay(attempt))
        raise AssertionError("unreachable")

    def rollouts(self, req: P.RolloutRequest) -> P.RolloutResponse:
        return P.RolloutResponse.model_validate(self._request("POST", "/v1/rollouts", json=self._rollout_body(req)).json())

    def rollouts_stream(self, req: P.RolloutRequest) -> Iterator[P.GroupEvent]:
        """Each group as it finishes (with its prompt's index); FarmError if the rollout fails midway. Stopping early
        closes the connection, which cancels the rollout. Retried only until the first line arrives: the request_id
        makes the retry a replay, not a second rollout."""
        body = self._rollout_body(req, stream=True)
        for attempt in range(self.retries + 1):
            sent = False
            try:
                with self.http.stream("POST", "/v1/rollouts", json=body) as r:
                    if r.status_code >= 400:
                        r.read()
                    if self._accept(r, attempt):
                        for line in r.iter_lines():
                            if not line:
                                continue
                            if (event := self._stream_line(line, r.status_code)) is None:
                                return
                            sent = True
                            yield event
                        raise FarmError(r.status_code, P.ErrorResponse(error="stream closed before its last line: the service went away").model_dump())
            except httpx.TransportError as e:
                if sent or self._give_up(e, attempt):
                    raise
            except FarmError as e:  # e.g. queues full before any group: the failed job is forgotten, so sending again is safe
                if sent or e.status not in RETRY_STATUS or attempt == self.retries:
                    raise
            time.sleep(self._delay(attempt))

    def cancel(self, request_id: str) -> P.CancelResponse:
        """Cancel a running rollout; cancelled=False when none with this id runs."""
        return P.CancelResponse.model_validate(self._request("DELETE", f"/v1/rollouts/{request_id}").json())

    def samplers(self) -> dict[str, str]:
        return self._request("GET", "/v1/samplers").json()

    def report_policy_stats(self, stats: P.PolicyStats) -> P.PolicyStats:
        """Tell the service's samplers the policy's KL, reward variance and step (needs the token); left-out fields keep their value."""
        return P.PolicyStats.model_validate(self._request("POST", "/v1/policy_stats", json=stats.model_dump(exclude_unset=True)).json())

    def push_weights(self, safetensors_bytes: bytes, version: int, policy: P.InFlightPolicy = "finish") -> P.WeightsPushResponse:
        """Upload a safetensors state dict as `version`, with its SHA-256; returns once every replica serves it."""
        r = self._request("POST", "/v1/weights", upload=safetensors_bytes, **self._weights_args(safetensors_bytes, version, policy))
        return P.WeightsPushResponse.model_validate(r.json())

    def push_weights_path(self, path: str, version: int, policy: P.InFlightPolicy = "finish") -> P.WeightsPushResponse:
        """Load a folder of safetensors files that every replica can read, as `version`."""
        body = P.WeightsFromPath(path=str(path), version=version, policy=policy).model_dump()
        return P.WeightsPushResponse.model_validate(self._request("POST", "/v1/weights/path", json=body).json())

    def weights_version(self) -> P.WeightsVersion:
        return P.WeightsVersion.model_validate(self._request("GET", "/v1/weights/version").json())

    def control(self, action: str) -> P.ControlResponse:
        """'pause', 'resume' or 'abort' on every replica (needs the token)."""
        return P.ControlResponse.model_validate(self._request("POST", f"/v1/{action}").json())

    def health(self) -> P.Health:
        return P.Health.model_validate(self._request("GET", "/healthz").json())

    def queue_add_source(self, spec: P.QueueSource) -> P.QueueSourceState:
        r = self._request("POST", "/v1/queue/sources", replay=False, json=spec.model_dump(exclude_none=True))
        return P.QueueSourceState.model_validate(r.json())

    def queue_sources(self) -> list[P.QueueSourceState]:
        return [P.QueueSourceState.model_validate(s) for s in self._request("GET", "/v1/queue/sources").json()]

    def queue_remove_source(self, name: str) -> P.QueueSourceState:
        return P.QueueSourceState.model_validate(self._request("DELETE", f"/v1/queue/sources/{name}", replay=False).json())

    def queue_add_prompts(self, name: str, prompts: list[P.Prompt]) -> P.QueueSourceState:
        body = P.QueuePrompts(prompts=prompts).model_dump(exclude_none=True)
        return P.QueueSourceState.model_validate(self._request("POST", f"/v1/queue/sources/{name}/prompts", replay=False, json=body).json())

    def queue_upload_jsonl(self, name: str, data: bytes) -> P.QueueSourceState:
        """Add prompts from JSONL bytes, one Prompt object per line."""
        return P.QueueSourceState.model_validate(self._request("POST", f"/v1/queue/sources/{name}/prompts", replay=False, **self._jsonl_args(data)).json())

    def queue_pull(self, req: P.PullRequest) -> P.PullResponse:
        """Lease groups. Not idempotent, so retried only on 429 and refused connections: a pull whose answer
        was lost leased its groups anyway; they are delivered again (same item_id) when the lease runs out."""
        return P.PullResponse.model_validate(self._request("POST", "/v1/queue/pull", replay=False, json=req.model_dump(exclude_none=True)).json())

    def queue_ack(self, item_ids: list[str]) -> P.AckResponse:
        """Settle used groups; acking twice is harmless, so this is retried like a read."""
        return P.AckResponse.model_validate(self._request("POST", "/v1/queue/ack", json={"item_ids": list(item_ids)}).json())

    def wait_ready(self, timeout_s: float = 300.0) -> P.Health:
        """Poll /healthz until the service generates a token, or raise TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return P.Health.model_validate(self.http.get("/healthz").raise_for_status().json())
            except (httpx.HTTPError, ValueError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"service at {self.http.base_url} not healthy after {timeout_s:.0f}s") from None
                time.sleep(0.5)


class AsyncFarmClient(_Retrying):
    """The same calls for asyncio code (httpx.AsyncClient)."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 600.0, retries: int = 4, backoff_s: float = 0.5, max_backoff_s: float = 8.0):
        super().__init__(token, retries, backoff_s, max_backoff_s)
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=self.headers, timeout=timeout)

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "AsyncFarmClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _request(self, method: str, path: str, replay: bool = True, upload: bytes | None = None, **kw) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                if upload is not None:
                    kw["content"] = _aslices(upload)
                r = await self.http.request(method, path, **kw)
                if self._accept(r, attempt, replay):
                    return r
            except httpx.TransportError as e:
                if self._give_up(e, attempt, replay):
                    raise
            await asyncio.sleep(self._delay(attempt))
        raise AssertionError("unreachable")

    async def rollouts(self, req: P.RolloutRequest) -> P.RolloutResponse:
        return P.RolloutResponse.model_validate((await self._request("POST", "/v1/rollouts", json=self._rollout_body(req))).json())

    async def rollouts_stream(self, req: P.RolloutRequest) -> AsyncIterator[P.GroupEvent]:
        """See FarmClient.rollouts_stream."""
        body = self._rollout_body(req, stream=True)
        for attempt in range(self.retries + 1):
            sent = False
            try:
                async with self.http.stream("POST", "/v1/rollouts", json=body) as r:
                    if r.status_code >= 400:
                        await r.aread()
                    if self._accept(r, attempt):
                        async for line in r.aiter_lines():
                            if not line:
                                continue
                            if (event := self._stream_line(line, r.status_code)) is None:
                                return
                            sent = True
                            yield event
                        raise FarmError(r.status_code, P.ErrorResponse(error="stream closed before its last line: the service went away").model_dump())
            except httpx.TransportError as e:
                if sent or self._give_up(e, attempt):
                    raise
            except FarmError as e:  # e.g. queues full before any group: the failed job is forgotten, so sending again is safe
                if sent or e.status not in RETRY_STATUS or attempt == self.retries:
                    raise
            await asyncio.sleep(self._delay(attempt))

    async def cancel(self, request_id: str) -> P.CancelResponse:
        return P.CancelResponse.model_validate((await self._request("DELETE", f"/v1/rollouts/{request_id}")).json())

    async def samplers(self) -> dict[str, str]:
        return (await self._request("GET", "/v1/samplers")).json()

    async def report_policy_stats(self, stats: P.PolicyStats) -> P.PolicyStats:
        return P.PolicyStats.model_validate((await self._request("POST", "/v1/policy_stats", json=stats.model_dump(exclude_unset=True))).json())

    async def push_weights(self, safetensors_bytes: bytes, version: int, policy: P.InFlightPolicy = "finish") -> P.WeightsPushResponse:
        r = await self._request("POST", "/v1/weights", upload=safetensors_bytes, **self._weights_args(safetensors_bytes, version, policy))
        return P.WeightsPushResponse.model_validate(r.json())

    async def push_weights_path(self, path: str, version: int, policy: P.InFlightPolicy = "finish") -> P.WeightsPushResponse:
        body = P.WeightsFromPath(path=str(path), version=version, policy=policy).model_dump()
        return P.WeightsPushResponse.model_validate((await self._request("POST", "/v1/weights/path", json=body)).json())

    async def weights_version(self) -> P.WeightsVersion:
        return P.WeightsVersion.model_validate((await self._request("GET", "/v1/weights/version")).json())

    async def control(self, action: str) -> P.ControlResponse:
        return P.ControlResponse.model_validate((await self._request("POST", f"/v1/{action}")).json())

    async def health(self) -> P.Health:
        return P.Health.model_validate((await self._request("GET", "/healthz")).json())

    async def queue_add_source(self, spec: P.QueueSource) -> P.QueueSourceState:
        r = await self._request("POST", "/v1/queue/sources", replay=False, json=spec.model_dump(exclude_none=True))
        return P.QueueSourceState.model_validate(r.json())

    async def queue_sources(self) -> list[P.QueueSourceState]:
        return [P.QueueSourceState.model_validate(s) for s in (await self._request("GET", "/v1/queue/sources")).json()]

    async def queue_remove_source(self, name: str) -> P.QueueSourceState:
        return P.QueueSourceState.model_validate((await self._request("DELETE", f"/v1/queue/sources/{name}", replay=False)).json())

    async def queue_add_prompts(self, name: str, prompts: list[P.Prompt]) -> P.QueueSourceState:
        body = P.QueuePrompts(prompts=prompts).model_dump(exclude_none=True)
        return P.QueueSourceState.model_validate((await self._request("POST", f"/v1/queue/sources/{name}/prompts", replay=False, json=body)).json())

    async def queue_upload_jsonl(self, name: str, data: bytes) -> P.QueueSourceState:
        r = await self._request("POST", f"/v1/queue/sources/{name}/prompts", replay=False, **self._jsonl_args(data))
        return P.QueueSourceState.model_validate(r.json())

    async def queue_pull(self, req: P.PullRequest) -> P.PullResponse:
        """See FarmClient.queue_pull: not idempotent."""
        return P.PullResponse.model_validate((await self._request("POST", "/v1/queue/pull", replay=False, json=req.model_dump(exclude_none=True))).json())

    async def queue_ack(self, item_ids: list[str]) -> P.AckResponse:
        return P.AckResponse.model_validate((await self._request("POST", "/v1/queue/ack", json={"item_ids": list(item_ids)})).json())
