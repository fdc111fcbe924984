"""Overload is expected, not an error: a full engine replica answers FULL instead of raising (Serve logs a traceback
for every exception a replica method raises), the ingress turns it into a 429 with Retry-After, counts it in
farm_overload_rejections_total and logs at most one WARNING line per kind every WARN_EVERY_S, with the number of
rejections since its last line. Serve's own per-request back-pressure warning is dropped from the ingress's log for
the same reason.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from rollout_farm.services.observability import metrics

log = logging.getLogger("farm.service")

WARN_EVERY_S = 5.0


class Full(NamedTuple):
    """What an engine replica returns for a rollout it has no room for (it pickles as itself across Ray)."""

    waiting: int  # rollouts already waiting for a slot on that replica


FULL_KINDS = {
    "replica_full": "an engine replica runs FARM_ENGINE_MAX_ONGOING_REQUESTS rollouts and its waiting room (its share "
    "of FARM_ENGINE_MAX_QUEUED_REQUESTS) is full",
    "engine_queue": "Serve's queue at the ingress for the engine replicas is full (a backstop: the replicas' slots "
    "and FARM_ENGINE_MAX_QUEUED_REQUESTS)",
}
for _kind in FULL_KINDS:  # exported at 0 from the start
    metrics.OVERLOAD.labels(_kind)


class RateLimitedWarning:
    """One WARNING line per key at most every `every_s` seconds; the lines in between are counted, and the next
    line says how many were left out (`suppressed`)."""

    def __init__(self, logger: logging.Logger, every_s: float = WARN_EVERY_S, clock=time.monotonic):
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self.last: dict[str, float] = {}
        self.suppressed: dict[str, int] = {}

    def __call__(self, event: str, key: str, **fields) -> bool:
        """Log `event` with `fields` unless one was logged for `key` less than every_s ago; True when it was."""
        now = self.clock()
        if key in self.last and now - self.last[key] < self.every_s:
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return False
        self.last[key] = now
        self.logger.warning(event, extra={**fields, "suppressed": self.suppressed.pop(key, 0)})
        return True


warn = RateLimitedWarning(log)


def rejected(kind: str, method: str) -> None:
    """Count one refused engine call and maybe log it (once per WARN_EVERY_S per kind)."""
    metrics.OVERLOAD.labels(kind).inc()
    warn("overloaded", kind, kind=kind, method=method, reason=FULL_KINDS[kind], answer="429 Retry-After")


class DropServeBackpressure(logging.Filter):
    """Serve's router logs a WARNING for every call it refuses (max_queued_requests); rejected() counts them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Request dropped due to backpressure")


def quiet_serve_backpressure() -> None:
    """In the ingress replica: leave Serve's per-request back-pressure warnings out of the log (idempotent)."""
    serve_log = logging.getLogger("ray.serve")
    if not any(isinstance(f, DropServeBackpressure) for f in serve_log.filters):
        serve_log.addFilter(DropServeBackpressure())
