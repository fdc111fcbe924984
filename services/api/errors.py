"""Every error answer, in one place: the service's own errors carry their status; the request's validation errors,
an engine's missing verb and Serve's own errors are mapped here. Serve's back-pressure becomes Overloaded at the
handle (services/replicas.py); one that gets past it is a 429 here too, not Serve's plain-text 503: Serve registers
its handlers for BackPressureError and DeploymentUnavailableError on the ingress app after ours, and
services/api/__init__.py keeps ours.

The body is always `{"error": "...", "detail": [{"field": "...", "message": "..."}]}` (P.ErrorResponse).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException

from services import protocol as P
from services.engine.base import EngineVerbMissing
from services.errors import (
    QUEUES_FULL,
    Invalid,
    NotSupported,
    Overloaded,
    ReplicaLost,
    ServiceError,
    Unavailable,
    pydantic_fields,
)
from services.overload import RateLimitedWarning
from services.state import STATE_ERRORS, unreachable

log = logging.getLogger("farm.service")
SERVE_ERRORS = (BackPressureError, DeploymentUnavailableError)  # Serve answers these in plain text unless mapped
unavailable = RateLimitedWarning(log)  # a 503 (not ready, a replica restarting) is a state, polled: one line per path


def as_service_error(exc: BaseException) -> ServiceError:
    """The error the service answers for `exc`: its own errors as they are, the request's validation and an engine's
    missing verb mapped to a status, anything else a 500."""
    if isinstance(exc, RayTaskError):  # raised in a replica: Ray's wrapper is also an instance of the original's class
        exc = exc.cause
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, RequestValidationError):
        return Invalid(pydantic_fields(exc.errors()))
    if isinstance(exc, EngineVerbMissing):  # its message names the engine and what to run instead
        return NotSupported(str(exc))
    if isinstance(exc, STATE_ERRORS):  # Redis does not answer: 503 with Retry-After
        return unreachable(exc)
    if isinstance(exc, BackPressureError):
        return Overloaded(QUEUES_FULL)
    if isinstance(exc, DeploymentUnavailableError):
        return ReplicaLost("no engine replica is running (starting or restarting): retry")
    if isinstance(exc, HTTPException):
        error = ServiceError(str(exc.detail))
        error.status = exc.status_code
        return error
    return ServiceError(f"internal error: {type(exc).__name__}; see the service log")


def response(error: ServiceError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s else None
    body = P.ErrorResponse(error=error.message, detail=error.detail).model_dump()
    return JSONResponse(status_code=error.status, content=body, headers=headers)


def install(api: FastAPI) -> None:
    """Register the handlers. Expected errors are handled without a traceback (a 503 logs a rate-limited warning);
    anything else is a logged 500."""

    async def expected(request: Request, exc: Exception) -> JSONResponse:
        error = as_service_error(exc)
        if isinstance(error, Unavailable):
            path = request.url.path
            unavailable("request_unavailable", path, path=path, status=error.status, error=error.message)
        elif error.status >= 500:
            log.error("request_failed", extra={"path": request.url.path, "status": error.status, "error": repr(exc)})
        return response(error)  # without Starlette's Allow on a 405: it names the first matching route's methods only

    for kind in (ServiceError, EngineVerbMissing, RequestValidationError, HTTPException, *SERVE_ERRORS, *STATE_ERRORS):
        api.add_exception_handler(kind, expected)

    @api.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled_error", extra={"path": request.url.path, "error": repr(exc)})
        return response(as_service_error(exc))
