"""The errors the service answers with, each with its HTTP status. Domain code raises them; `services/api/errors.py`
turns them (and the errors of the libraries underneath) into the one error body, in one place.

They cross Ray (raised in an engine replica, caught at the ingress): each pickles as its class, message and detail,
whatever its constructor takes.
"""

from __future__ import annotations


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


class Invalid(ServiceError):
    """422: the named fields are wrong; nothing was changed."""

    status = 422

    def __init__(self, detail: list[dict], message: str = "invalid request: fix the named fields"):
        super().__init__(message, detail)


class Unauthorized(ServiceError):
    status = 401


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
    FARM_ENGINE_MAX_QUEUED_REQUESTS waiting (it answers services.overload.Full; the ingress raises this)."""

    def __init__(self, message: str = QUEUES_FULL):
        super().__init__(message)
