"""The HTTP surface: one router per API area, thin routes over the ingress's domain objects (services/ingress.py).

Each area module has `router` (open to all) and, where it has mutating endpoints, `admin`, included here behind
the bearer token. Errors map to statuses in errors.py.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI

from services import protocol as P
from services.api import control, errors, openai, queue, rollouts, samplers, sglang, weights
from services.api.deps import require_token
from services.api.middleware import BodyLimit, record_request

OPEN = (rollouts.router, samplers.router, weights.router, queue.router, control.router, openai.router, sglang.router)
NEED_TOKEN = (rollouts.admin, samplers.admin, weights.admin, queue.admin, control.admin, sglang.admin)


class FarmAPI(FastAPI):
    """FastAPI whose handlers for Serve's errors stay ours: Serve adds plain-text ones (BackPressureError: 503 without
    Retry-After) to the ingress app after create_api() has registered ours (errors.SERVE_ERRORS)."""

    def add_exception_handler(self, exc_class_or_status_code, handler) -> None:
        if exc_class_or_status_code in errors.SERVE_ERRORS and exc_class_or_status_code in self.exception_handlers:
            return
        super().add_exception_handler(exc_class_or_status_code, handler)


def create_api() -> FastAPI:
    api = FarmAPI(
        title="rollout-farm", version=P.API_VERSION, description="Rollout service for LLM reinforcement learning."
    )
    errors.install(api)
    api.add_middleware(BodyLimit)
    api.middleware("http")(record_request)
    unauthorized = {401: {"model": P.ErrorResponse}}
    for router in OPEN:
        api.include_router(router)
    for router in NEED_TOKEN:
        api.include_router(router, dependencies=[Depends(require_token)], responses=unauthorized)
    return api
