"""A typed Python client for the rollout service, for our trainer and for other frameworks (verl, TRL, ...).

Connection failures, 429 and 502-504 are retried with capped exponential backoff and jitter.
A 4xx is raised at once as FarmError, carrying the service's field-by-field detail.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import httpx

from services import protocol as P

RETRY_STATUS = {429, 502, 503, 504}


class FarmError(RuntimeError):
    def __init__(self, status: int, body: dict | str):
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}: {body}")


class _Retrying:
    """What the sync and async clients share: settings, backoff and the reading of a response."""

    def __init__(self, token: str | None, retries: int, backoff_s: float, max_backoff_s: float):
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s

    def _delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2 ** attempt))  # full jitter

    def _accept(self, r: httpx.Response, attempt: int) -> bool:
        """True for a success; False to retry; raises FarmError for a final error."""
        if r.status_code < 400:
            return True
        if r.status_code in RETRY_STATUS and attempt < self.retries:
            return False
        try:
            body = r.json()
        except ValueError:
            body = r.text
        raise FarmError(r.status_code, body)

    @staticmethod
    def _rollout_body(req: P.RolloutRequest) -> dict:
        """The request under a request_id (a fresh one unless given), so that every retry is safe."""
        if req.request_id is None:
            req = req.model_copy(update={"request_id": uuid.uuid4().hex})
        return req.model_dump(exclude_none=True)


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

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                r = self.http.request(method, path, **kw)
                if self._accept(r, attempt):
                    return r
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
            time.sleep(self._delay(attempt))
        raise AssertionError("unreachable")

    def rollouts(self, req: P.RolloutRequest) -> P.RolloutResponse:
        return P.RolloutResponse.model_validate(self._request("POST", "/v1/rollouts", json=self._rollout_body(req)).json())

    def push_weights(self, safetensors_bytes: bytes, version: int) -> P.WeightsPushResponse:
        r = self._request("POST", "/v1/weights", params={"version": version}, content=safetensors_bytes,
                          headers={"Content-Type": "application/octet-stream"})
        return P.WeightsPushResponse.model_validate(r.json())

    def weights_version(self) -> P.WeightsVersion:
        return P.WeightsVersion.model_validate(self._request("GET", "/v1/weights/version").json())

    def control(self, action: str) -> P.ControlResponse:
        """'pause', 'resume' or 'abort' on every replica (needs the token)."""
        return P.ControlResponse.model_validate(self._request("POST", f"/v1/{action}").json())

    def health(self) -> P.Health:
        return P.Health.model_validate(self._request("GET", "/healthz").json())

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

    async def _request(self, method: str, path: str, **kw) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                r = await self.http.request(method, path, **kw)
                if self._accept(r, attempt):
                    return r
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
            await asyncio.sleep(self._delay(attempt))
        raise AssertionError("unreachable")

    async def rollouts(self, req: P.RolloutRequest) -> P.RolloutResponse:
        return P.RolloutResponse.model_validate((await self._request("POST", "/v1/rollouts", json=self._rollout_body(req))).json())

    async def push_weights(self, safetensors_bytes: bytes, version: int) -> P.WeightsPushResponse:
        r = await self._request("POST", "/v1/weights", params={"version": version}, content=safetensors_bytes,
                                headers={"Content-Type": "application/octet-stream"})
        return P.WeightsPushResponse.model_validate(r.json())

    async def weights_version(self) -> P.WeightsVersion:
        return P.WeightsVersion.model_validate((await self._request("GET", "/v1/weights/version")).json())

    async def control(self, action: str) -> P.ControlResponse:
        return P.ControlResponse.model_validate((await self._request("POST", f"/v1/{action}")).json())

    async def health(self) -> P.Health:
        return P.Health.model_validate((await self._request("GET", "/healthz")).json())
