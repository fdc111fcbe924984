"""The engine replicas as the ingress sees them: one Serve handle, calls to one replica or to every replica.

Serve's own back-pressure (a full engine queue, FARM_ENGINE_MAX_QUEUED_REQUESTS) becomes Overloaded here, at the
handle: left as BackPressureError, Serve's handler on the ingress app would answer it 503 without Retry-After.
"""

from __future__ import annotations

import logging

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from services import protocol as P
from services.errors import QUEUES_FULL, Overloaded, Unavailable

log = logging.getLogger("farm.service")

READ_TIMEOUT_S = 30


class ReplicaCall:
    """A call to one replica: await it for the result, or cancel() it (its engine work stops at the next token)."""

    def __init__(self, response: DeploymentResponse):
        self.response = response

    def cancel(self) -> None:
        try:
            self.response.cancel()
        except Exception:  # Serve raises the call's own failure (a full queue) here: nothing is left to cancel
            pass

    def __await__(self):
        return self._result().__await__()

    async def _result(self):
        try:
            return await self.response
        except BackPressureError:
            raise Overloaded(QUEUES_FULL) from None


class Replicas:
    def __init__(self, handle: DeploymentHandle):
        self.handle = handle

    def call(self, method: str, *args) -> ReplicaCall:
        """One replica's `method` (Serve picks the replica)."""
        return ReplicaCall(getattr(self.handle, method).remote(*args))

    async def each(self, method: str, *args, timeout_s: float = READ_TIMEOUT_S) -> list:
        """`method` on every replica; an exception in the list for each replica that failed."""
        results = await self.handle.broadcast(method, *args).results_async(timeout_s=timeout_s, return_exceptions=True)
        return [Overloaded(QUEUES_FULL) if isinstance(r, BackPressureError) else r for r in results]

    async def failures(self, method: str, *args, timeout_s: float, setting: str) -> list[str]:
        """`method` on every replica; one line per failure ([] when all succeed). `setting` names the timeout's."""
        try:
            results = await self.each(method, *args, timeout_s=timeout_s)
        except TimeoutError:
            return [f"replicas did not finish {method} within {setting}={timeout_s:g}"]
        return [str(r).strip().splitlines()[-1] for r in results if isinstance(r, Exception)]

    async def all(self, method: str, *args, timeout_s: float = READ_TIMEOUT_S) -> list:
        """`method` on every replica; the first failure is raised."""
        results = await self.each(method, *args, timeout_s=timeout_s)
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results

    async def versions(self) -> dict[str, int]:
        """replica id -> the weight version it serves."""
        return dict(await self.all("weight_version"))

    async def states(self, timeout_s: float = READ_TIMEOUT_S) -> list[P.ReplicaState | Exception]:
        return await self.each("state", timeout_s=timeout_s)

    async def control(self, action: str) -> P.ControlResponse:
        """Pause, resume or abort on every replica; their states after it."""
        states = await self.all(action)
        log.info("control", extra={"action": action, "replicas": len(states)})
        return P.ControlResponse(action=action, replicas=states)

    async def readiness(self) -> P.Readiness:
        """Ready when every replica answers, none is paused, and all serve one weight version; else 503."""
        states = await self.states()
        problems = [str(s) for s in states if isinstance(s, Exception)]
        alive = [s for s in states if not isinstance(s, Exception)]
        problems += [f"replica {s.replica} is paused" for s in alive if s.paused]
        if len({s.weight_version for s in alive}) > 1:
            problems.append("replicas serve different weight versions")
        if problems:
            raise Unavailable("not ready", [{"field": "replica", "message": m} for m in problems])
        return P.Readiness(ready=True, replicas=alive)
