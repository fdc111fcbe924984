"""Every error answer, in one place: the error body and the handlers. Which status an exception answers with is
`services.errors.as_service_error`. Serve's back-pressure becomes Overloaded at the
handle (services/replica/handle.py); one that gets past it is a 429 too, not Serve's plain-text 503: Serve registers
its handlers for BackPressureError and DeploymentUnavailableError on the ingress app after ours, and
services/api/__init__.py keeps ours.

The body is always `{"error": "...", "detail": [{"field": "...", "message": "..."}]}` (P.ErrorResponse).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from services import protocol as P
from services.errors import (
    SERVE_ERRORS,
    STATE_ERRORS,
    EngineVerbMissing,
    ServiceError,
    Unavailable,
    as_service_error,
)
from services.replica.overload import RateLimitedWarning

log = logging.getLogger("farm.service")
unavailable = RateLimitedWarning(log)  # a 503 (not ready, a replica restarting) is a state, polled: one line per path


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
