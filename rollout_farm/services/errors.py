"""The errors the service answers with, each with its HTTP status, and `as_service_error`: the one mapping of any
exception (ours, the request's validation, an engine's missing verb, Redis, Ray and Serve) to one of them. Domain
code raises them and may map what it catches (a rollout job records its failure); `rollout_farm/services/api/errors.py`
writes the error body and registers the handlers.

They cross Ray (raised in an engine replica, caught at the ingress): each pickles as its class, message and detail,
whatever its constructor takes.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import redis
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect


def pydantic_fields(errors: list[dict], *prefix: str) -> list[dict]:
    """pydantic's errors as 422 detail: the dotted field (under `prefix`) and the message."""
    return [
        {"field": ".".join([*prefix, *(str(x) for x in e["loc"] if x != "body")]), "message": _message(e)}
        for e in errors
    ]


def _message(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "not a field of this request (misspelt, or not supported): remove it; GET /openapi.json lists the fields"
    return error["msg"]


class ServiceError(Exception):
    """An error with a status, a message that says how to fix it, and per-field detail."""

    status = 500
    retry_after_s: int | None = None

    def __init__(self, message: str, detail: list[dict] | None = None):
        super().__init__(message)
        self.message, self.detail = message, detail or []

    def __reduce__(self):
        return _rebuilt, (type(self), self.message, self.detail)


def _rebuilt(cls: type[ServiceError], message: str, detail: list[dict]) -> ServiceError:
    error = cls.__new__(cls)
    ServiceError.__init__(error, message, detail)
    return error


QUEUES_FULL = "engine queues are full (FARM_ENGINE_MAX_QUEUED_REQUESTS): retry after 1 s"


SCHEMA_MISMATCH = "invalid request: it does not match its schema (GET /openapi.json): fix the named fields"
MODEL_GAP = "a model the service built from the request refused it, which the request's own checks let through"


class Invalid(ServiceError):
    """422: the named fields are wrong; nothing was changed."""

    status = 422

    def __init__(self, detail: list[dict], message: str = "invalid request: fix the named fields"):
        super().__init__(message, detail)


class ClientGone(ServiceError):
    """The client closed the connection before its request ended (a cut upload, or a request Serve cancelled when its
    client went away); nobody reads the answer, its status is for the request metrics."""

    status = 400

    def __init__(
        self,
        message: str = "the client closed the connection before the request body ended: nothing was "
        "changed; send the request again",
    ):
        super().__init__(message)


CANCELLED = (
    "the client went away before its request ended, and Serve cancelled the request: send it again if its answer "
    "is needed"
)


class Unauthorized(ServiceError):
    status = 401


class Forbidden(ServiceError):
    """403: the caller may see this, but not change it."""

    status = 403


class NotFound(ServiceError):
    status = 404


class Conflict(ServiceError):
    status = 409


class TooLarge(ServiceError):
    status = 413


class Overloaded(ServiceError):
    """429 with Retry-After: queues are full; the client retries later."""

    status = 429
    retry_after_s = 1


class Unavailable(ServiceError):
    """503: not ready to serve (a replica paused, missing, or on another version)."""

    status = 503


class ReplicaLost(Unavailable):
    """503 with Retry-After: the engine replica serving the call died or became unreachable (Serve restarts it)."""

    retry_after_s = 1


class FarmPaused(Unavailable):
    """503 with Retry-After: the request waited on a paused replica (POST /v1/pause, /pause_generation) for
    FARM_PAUSE_WAIT_S, and nothing of it was kept (rollout_farm/services/replica/pause_bound.py)."""

    retry_after_s = 1

    @classmethod
    def waited(cls, replica: str, paused_at: float, waited_s: float, limit_s: float) -> FarmPaused:
        """`paused_at`: when the pause began (wall-clock seconds); `waited_s`: how long this request waited on it."""
        since = datetime.fromtimestamp(paused_at, timezone.utc).isoformat(timespec="seconds")
        return cls(
            f"the farm is paused (POST /v1/pause or /pause_generation; replica {replica} since {since}): this request "
            f"waited {waited_s:.1f} s for the resume, the most FARM_PAUSE_WAIT_S={limit_s:g} allows, and generated "
            "nothing: send it again once the farm is resumed (POST /v1/resume or /continue_generation); a request_id "
            "runs anew",
            [{"field": "paused", "message": f"replica {replica} paused since {since}; waited {waited_s:.1f} s"}],
        )


class PolicyMismatch(ServiceError):
    """503: a sample came back from another policy than the one the request named; nothing was delivered."""

    status = 503
    retry_after_s = 1


class NotSupported(ServiceError):
    """501: the engine serving this app lacks the verb (e.g. the NCCL transport on the torch engine)."""

    status = 501


class ReplicasFailed(ServiceError):
    """Replicas failed a weight push's phase; the message says which version every replica is left on."""

    status = 500


class VersionNotReached(Conflict):
    """A rollout asked for a weight version that no push has committed in time."""

    def __init__(self, message: str):
        super().__init__(
            message,
            [{"field": "min_weight_version", "message": "push that version first, or ask for one that is committed"}],
        )


class RolloutCancelled(Conflict):
    """The rollout was cancelled (DELETE /v1/rollouts/{request_id}, or its last caller went away)."""

    def __init__(
        self, message: str = "request cancelled (DELETE /v1/rollouts/{request_id}); send it again to generate anew"
    ):
        super().__init__(message)


class ReplicaFull(Overloaded):
    """A replica already runs FARM_ENGINE_MAX_ONGOING_REQUESTS rollouts and holds its share of
    FARM_ENGINE_MAX_QUEUED_REQUESTS waiting (it answers rollout_farm.services.replica.overload.Full; the ingress raises
    this)."""

    def __init__(self, message: str = QUEUES_FULL):
        super().__init__(message)


class StateUnavailable(Unavailable):
    """503 with Retry-After: Redis does not answer; nothing was changed."""

    retry_after_s = 2


STATE_ERRORS = (redis.ConnectionError, redis.TimeoutError)  # redis-py wraps socket errors in these
SERVE_ERRORS = (BackPressureError, DeploymentUnavailableError)  # Serve answers these in plain text unless mapped


def unreachable(error: BaseException) -> StateUnavailable:
    return StateUnavailable(
        f"control-plane state unreachable (Redis: {type(error).__name__}); nothing was changed: retry after 2 s"
    )


class EngineVerbMissing(NotImplementedError):
    """This engine does not offer the verb; the service answers 501 with this message. (It crosses Ray, so it is
    built from its message alone.)"""

    @classmethod
    def of(cls, engine: object, verb: str, instead: str) -> EngineVerbMissing:
        return cls(f"the {type(engine).__name__} engine has no {verb}: {instead}")


def described(e: BaseException) -> str:
    """`Type: message` for a log line (redis-py's repr() of its errors leaves the message out)."""
    return f"{type(e).__name__}: {e}"[:500]


def replica_gone(e: BaseException) -> bool:
    """Whether `e` says the replica itself is gone (dead, unreachable, none running), not that its method failed."""
    return isinstance(e, (RayActorError, DeploymentUnavailableError)) and not isinstance(e, RayTaskError)


def call_cancelled(e: BaseException) -> bool:
    """Whether a replica call ended because it was cancelled: Serve cancels a request's calls to the replicas when
    its client goes away (Ray's TaskCancelledError, Serve's RequestCancelledError, or the asyncio future's own)."""
    return isinstance(e, (TaskCancelledError, asyncio.CancelledError))


def request_models() -> set[str]:
    """The names of the request models (rollout_farm/services/protocol/'s RequestModel and its subclasses, plug-ins'
    included)."""
    from rollout_farm.services.protocol.common import RequestModel

    found, todo = set(), [RequestModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub.__name__)
            todo.append(sub)
    return found


def model_gap(exc: ValidationError) -> Invalid:
    """A request model built inside a handler from the request's data refused it: the request is at fault (a 422
    naming the field as that model names it), and the request's own model lacks that check (a service bug: the
    handler logs it, and the fuzz test fails on MODEL_GAP). A ValidationError of any other model is a 500."""
    detail = [
        {"field": ".".join(str(x) for x in e["loc"]) or "body", "message": f"{_message(e)} ({exc.title})"}
        for e in exc.errors()
    ]
    return Invalid(detail, f"invalid request: {MODEL_GAP}: fix the named fields")


def as_service_error(exc: BaseException) -> ServiceError:
    """The error the service answers for `exc`: its own errors as they are, the request's validation (422), a request
    model refusing what a handler built from the request (422, model_gap), a cut request body, an engine's missing
    verb mapped to a status, anything else a 500."""
    if isinstance(exc, RayTaskError):  # raised in a replica: Ray's wrapper is also an instance of the original's class
        exc = exc.cause
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, RequestValidationError):
        beyond = all(e["type"] == "beyond_schema" for e in exc.errors())  # protocol/common.py, beyond_schema
        return (
            Invalid(pydantic_fields(exc.errors()))
            if beyond
            else Invalid(pydantic_fields(exc.errors()), SCHEMA_MISMATCH)
        )
    if isinstance(exc, ValidationError) and exc.title in request_models():
        return model_gap(exc)
    if isinstance(exc, ClientDisconnect):
        return ClientGone()
    if call_cancelled(exc):  # Serve's receive() or a replica call, once the client went away
        return ClientGone(CANCELLED)
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
