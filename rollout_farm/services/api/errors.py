"""Every error answer, in one place: the error body and the handlers. Which status an exception answers with is
`rollout_farm.services.errors.as_service_error`. Serve's back-pressure becomes Overloaded at the
handle (rollout_farm/services/replica/handle.py); one that gets past it is a 429 too, not Serve's plain-text 503: Serve
registers its handlers for BackPressureError and DeploymentUnavailableError on the ingress app after ours, and
rollout_farm/services/api/__init__.py keeps ours.

The body is always `{"error": "...", "detail": [{"field": "...", "message": "..."}]}` (P.ErrorResponse).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import (
    SERVE_ERRORS,
    STATE_ERRORS,
    ClientGone,
    EngineVerbMissing,
    NotSupported,
    ServiceError,
    Unavailable,
    as_service_error,
    described,
)
from rollout_farm.services.replica.overload import RateLimitedWarning

log = logging.getLogger("farm.service")
# a 503 (not ready, a replica restarting) is a state, polled, and a 501 a lasting answer: one line per path and 5 s
unavailable = RateLimitedWarning(log)


@contextlib.contextmanager
def refusal_logged(transport: str, version: int | str | None):
    """Around a weight push: a refusal (4xx: weights the model or an engine refuses, a cut or oversized upload, a
    stale version) logs one WARNING line, with the reasons; the replicas return theirs without a traceback
    (EngineServer.stage). A push that Serve cancels because its client went away (while it waits for the push lock
    or for a bucket's staging, where no body read sees the disconnect) logs one request_cut line, as a cut body
    does. Anything else goes on to the handlers."""
    try:
        yield
    except asyncio.CancelledError:  # Serve cancelled the request (its client went away): no handler sees it
        log.warning(
            "request_cut",
            extra={
                "transport": transport,
                "version": version,
                "error": "the client went away mid-push: Serve cancelled the request; the push is abandoned "
                "unless it had reached its commit",
            },
        )
        raise
    except ServiceError as e:
        if e.status < 500:
            reasons = [f"{d.get('field')}: {d.get('message')}" for d in e.detail]
            log.warning(
                "weight_push_refused",
                extra={
                    "transport": transport,
                    "version": version,
                    "status": e.status,
                    "error": e.message,
                    "reasons": reasons,
                },
            )
        raise


def response(error: ServiceError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s else None
    body = P.ErrorResponse(error=error.message, detail=error.detail).model_dump()
    return JSONResponse(status_code=error.status, content=body, headers=headers)


def install(api: FastAPI) -> None:
    """Register the handlers. Expected errors are handled without a traceback (a 503 or a 501 logs a rate-limited
    warning; a cut request body and a request model's missing check one warning line each); anything else is a logged
    500."""

    async def expected(request: Request, exc: Exception) -> JSONResponse:
        error, path = as_service_error(exc), request.url.path
        if isinstance(error, Unavailable):
            unavailable("request_unavailable", path, path=path, status=error.status, error=error.message)
        elif isinstance(error, NotSupported):  # documented (the torch engine's NCCL verbs): a line, not an error
            unavailable("request_not_supported", f"501 {path}", path=path, status=error.status, error=error.message)
        elif isinstance(error, ClientGone):  # a cut upload or a cancelled request: the client went away
            log.warning("request_cut", extra={"path": path, "error": error.message})
        elif isinstance(exc, ValidationError) and error.status == 422:  # a check missing from a request model
            log.warning("request_model_gap", extra={"path": path, "model": exc.title, "error": described(exc)})
        elif error.status >= 500:
            log.error(
                "request_failed",
                extra={"path": path, "status": error.status, "error": repr(exc)},
                exc_info=exc if isinstance(exc, ValidationError) else None,  # a server bug: where it was raised
            )
        return response(error)  # without Starlette's Allow on a 405: it names the first matching route's methods only

    gone = (ClientDisconnect, TaskCancelledError)  # Serve's receive() raises either mid-body once the client is gone
    kinds = (ServiceError, EngineVerbMissing, RequestValidationError, ValidationError, *gone, HTTPException)
    for kind in (*kinds, *SERVE_ERRORS, *STATE_ERRORS):
        api.add_exception_handler(kind, expected)

    @api.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled_error", extra={"path": request.url.path, "error": repr(exc)})
        return response(as_service_error(exc))
