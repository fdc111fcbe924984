"""Every error answer, in one place: the service's own errors carry their status; the libraries' are mapped here.

The body is always `{"error": "...", "detail": [{"field": "...", "message": "..."}]}` (P.ErrorResponse).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException

from services import protocol as P
from services.errors import Invalid, NotSupported, Overloaded, ServiceError, pydantic_fields

log = logging.getLogger("farm.service")


def as_service_error(exc: BaseException) -> ServiceError:
    """The error the service answers for `exc`: its own errors as they are, the libraries' mapped to a status."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, BackPressureError):  # Serve's own queue limit; services/replicas.py maps it first
        return Overloaded("engine queues are full (FARM_ENGINE_MAX_QUEUED_REQUESTS): retry after 1 s")
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return Invalid(pydantic_fields(exc.errors()))
    if isinstance(exc, NotImplementedError):  # an engine without the verb; the message names the engine
        return NotSupported(str(exc).strip().splitlines()[-1])
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
    """Register the handlers. Expected errors are handled without a traceback; anything else is a logged 500."""

    async def expected(request: Request, exc: Exception) -> JSONResponse:
        error = as_service_error(exc)
        if error.status >= 500:
            log.error("request_failed", extra={"path": request.url.path, "status": error.status, "error": repr(exc)})
        return response(error)

    for kind in (
        ServiceError,
        BackPressureError,
        NotImplementedError,
        ValidationError,
        RequestValidationError,
        HTTPException,
    ):
        api.add_exception_handler(kind, expected)

    @api.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled_error", extra={"path": request.url.path, "error": repr(exc)})
        return response(as_service_error(exc))
