"""Middleware on every request: the JSON body limit, and request counts and latency for Prometheus."""

from __future__ import annotations

import time

from ray import serve
from ray.serve.exceptions import RayServeException
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException

from rollout_farm.services.api.errors import response
from rollout_farm.services.errors import TooLarge
from rollout_farm.services.observability import metrics

MAX_REQUEST_BYTES = 32 << 20  # JSON bodies; weight pushes and prompt uploads have their own FARM_ limits
OWN_LIMITS = ("/v1/weights",)  # and /v1/queue/sources/{name}/prompts: streamed, counted against a FARM_ limit


def has_own_limit(path: str) -> bool:
    return path in OWN_LIMITS or (path.startswith("/v1/queue/sources/") and path.endswith("/prompts"))


class BodyLimit:
    """413 for a body over MAX_REQUEST_BYTES, declared or (chunked) counted as it arrives."""

    def __init__(self, app, limit: int = MAX_REQUEST_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))  # the app's path, under a route prefix
        if scope["type"] != "http" or has_own_limit(path):
            return await self.app(scope, receive, send)
        message = f"request body over {self.limit} bytes: send fewer prompts per request"
        if int(dict(scope["headers"]).get(b"content-length", 0)) > self.limit:
            return await response(TooLarge(message))(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            event = await receive()
            seen += len(event.get("body", b""))
            if seen > self.limit:  # an HTTPException: FastAPI passes those through its body parsing unchanged
                raise HTTPException(413, message)
            return event

        await self.app(scope, counted, send)


def replica_context():
    """Serve's replica context; None where the app runs outside Serve (unit tests with a bare TestClient)."""
    try:
        return serve.get_replica_context()
    except RayServeException:
        return None


class RequestMetrics:
    """farm_request_seconds (until the response starts) and farm_requests_total, by route template and status; the
    answering ingress replica in the X-Farm-Ingress header. Plain ASGI, like BodyLimit: Starlette's
    BaseHTTPMiddleware would run every chunk of a request body through a task of its own (a weight push has
    thousands)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()

        async def measured(message):
            if message["type"] == "http.response.start":
                if context := replica_context():
                    MutableHeaders(scope=message)["x-farm-ingress"] = context.replica_id.unique_id
                route = scope.get("route")  # the router sets it on this same scope
                path = route.path if route else "other"
                metrics.LATENCY.labels(path).observe(time.perf_counter() - start)
                metrics.REQUESTS.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, measured)
