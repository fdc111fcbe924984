"""The engine replicas as the ingress sees them: one Serve handle, calls to one replica or to every replica.

Overload is a 429 with Retry-After, whichever layer refuses (rollout_farm/services/replica/overload.py): a replica with
no room answers overload.Full (and a refusal it expects, such as a weight version not there, as the ServiceError itself,
raised here), and Serve's own back-pressure (the ingress's queue for the replicas,
FARM_ENGINE_MAX_QUEUED_REQUESTS) raises BackPressureError at the handle; both become Overloaded here. (Left as
BackPressureError, Serve's handler on the ingress app would answer a plain-text 503; rollout_farm/services/api/errors.py
maps any that gets past this.) The ingress deployment itself has no queue limit, so Serve's proxy never drops a request:
it waits for the ingress, which answers 429 at once when the engines are full. A replica that dies under a call is
ReplicaLost (503, Retry-After).

Reads of every replica (versions, states, health) answer with the replicas that answered and a line for each one
that did not (dead, restarting, or missing from FARM_REPLICAS), so they keep answering while Serve replaces one.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import (
    QUEUES_FULL,
    Overloaded,
    ReplicaFull,
    ReplicaLost,
    ServiceError,
    Unavailable,
    replica_gone,
)
from rollout_farm.services.replica import overload

log = logging.getLogger("farm.service")

READ_TIMEOUT_S = 30
REPLICA_NAME = re.compile(r"SERVE_REPLICA::[^\s#]+#[^\s#]+#(\w+)")  # a replica actor's name in Ray's errors
NO_REPLICA = "no engine replica is running (starting or restarting): retry"


def missing(e: BaseException) -> str:
    """A line for a replica that did not answer: its id where Ray's error names it, and what happened."""
    name = REPLICA_NAME.search(str(e))
    who = f"replica {name.group(1)}" if name else "a replica"
    lines = str(e).strip().splitlines()
    return f"{who} did not answer: {type(e).__name__}" + (f" ({lines[-1].strip()[:200]})" if lines else "")


def unwrapped(result):
    """A broadcast's result as the ingress handles it: back-pressure as Overloaded, a replica's ServiceError as
    itself (Ray wraps it)."""
    if isinstance(result, BackPressureError):
        return Overloaded(QUEUES_FULL)
    if isinstance(result, RayTaskError) and isinstance(result.cause, ServiceError):
        return result.cause
    return result


class ReplicaCall:
    """A call to one replica: await it for the result, or cancel() it (its engine work stops at the next token)."""

    def __init__(self, response: DeploymentResponse, method: str):
        self.response, self.method = response, method

    def cancel(self) -> None:
        try:
            self.response.cancel()
        except Exception:  # Serve raises the call's own failure (a full queue) here: nothing is left to cancel
            pass

    def __await__(self):
        return self._result().__await__()

    async def _result(self):
        try:
            result = await self.response
        except BackPressureError:
            overload.rejected("engine_queue", self.method)
            raise Overloaded(QUEUES_FULL) from None
        except (RayActorError, DeploymentUnavailableError) as e:
            if not replica_gone(e):
                raise
            raise ReplicaLost(f"the engine replica died during {self.method}: retry", [field_of(e)]) from None
        return answered(result, self.method)


def answered(result, method: str):
    """A replica's answer to one call: its result, or the expected refusal it answered with, raised."""
    if isinstance(result, overload.Full):
        overload.rejected("replica_full", method)
        raise ReplicaFull()
    if isinstance(result, ServiceError):  # an expected refusal the replica answered with (e.g. a version not there)
        raise result
    return result


def field_of(e: BaseException) -> dict:
    return {"field": "replica", "message": missing(e)}


@dataclass
class Survey:
    """One method on every replica: the answers, the replicas that answered with a service error (e.g. one that
    cannot sample), and a line for each replica that did not answer."""

    answers: list = field(default_factory=list)
    failed: list[ServiceError] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        return [*(e.message for e in self.failed), *self.missing]


class Replicas:
    def __init__(self, handle: DeploymentHandle):
        self.handle = handle
        overload.quiet_serve_backpressure()  # this runs in the ingress replica

    def call(self, method: str, *args, key: str | None = None, local: bool = True) -> ReplicaCall:
        """One replica's `method` (Serve picks the replica); with `key` (a session's id), the key's home replica
        while it is healthy (rollout_farm/services/replica/session_routes.py). `local`: the call may run on the
        caller's own engine where it has one (FARM_FRONT=fused, rollout_farm/services/serving/fused_front.py); the split
        front's ingress has none."""
        handle = self.handle.options(multiplexed_model_id=key) if key else self.handle
        return ReplicaCall(getattr(handle, method).remote(*args), method)

    async def read(self, method: str, *args, attempts: int = 3):
        """An idempotent `method` on one replica; on another if the first dies under it."""
        for attempt in range(attempts):
            try:
                return await self.call(method, *args)
            except ReplicaLost:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.2)

    async def each(self, method: str, *args, timeout_s: float = READ_TIMEOUT_S) -> list:
        """`method` on every running replica; an exception in the list for each replica that failed."""
        results = await self.handle.broadcast(method, *args).results_async(timeout_s=timeout_s, return_exceptions=True)
        return [unwrapped(r) for r in results]

    async def survey(self, method: str, *args, expected: int = 0, timeout_s: float = READ_TIMEOUT_S) -> Survey:
        """`method` on every replica, never raising: who answered, who failed, who is missing. `expected`
        (FARM_REPLICAS) counts the replicas Serve has not (re)started yet as missing."""
        try:
            results = await self.each(method, *args, timeout_s=timeout_s)
        except asyncio.TimeoutError:  # TimeoutError from 3.11, its own class on 3.10
            return Survey(missing=[f"no replica answered {method} within {timeout_s:g} s"])
        except DeploymentUnavailableError:
            return Survey(missing=[NO_REPLICA])
        found = Survey(
            answers=[r for r in results if not isinstance(r, Exception)],
            failed=[r for r in results if isinstance(r, ServiceError)],
            missing=[missing(r) for r in results if isinstance(r, Exception) and not isinstance(r, ServiceError)],
        )
        if (short := expected - len(results)) > 0:
            found.missing.append(f"{short} of FARM_REPLICAS={expected} replicas not running: starting or restarting")
        return found

    async def errors(self, method: str, *args, timeout_s: float, setting: str) -> list[Exception]:
        """`method` on every replica; its failures ([] when all succeed). `setting` names the timeout's."""
        try:
            results = await self.each(method, *args, timeout_s=timeout_s)
        except asyncio.TimeoutError:  # TimeoutError from 3.11, its own class on 3.10
            return [Unavailable(f"replicas did not finish {method} within {setting}={timeout_s:g}")]
        except DeploymentUnavailableError:
            return [Unavailable(NO_REPLICA)]
        return [r for r in results if isinstance(r, Exception)]

    async def failures(self, method: str, *args, timeout_s: float, setting: str) -> list[str]:
        """`method` on every replica; one line per failure ([] when all succeed). `setting` names the timeout's."""
        errors = await self.errors(method, *args, timeout_s=timeout_s, setting=setting)
        return [str(e).strip().splitlines()[-1] for e in errors]

    async def all(self, method: str, *args, timeout_s: float = READ_TIMEOUT_S) -> list:
        """`method` on every replica; the first failure is raised (a replica that is gone as ReplicaLost, 503)."""
        try:
            results = await self.each(method, *args, timeout_s=timeout_s)
        except asyncio.TimeoutError:  # TimeoutError from 3.11, its own class on 3.10
            raise ReplicaLost(f"replicas did not answer {method} within {timeout_s:g} s: retry") from None
        except DeploymentUnavailableError:
            raise ReplicaLost(NO_REPLICA) from None
        for r in results:
            if isinstance(r, Exception):
                raise ReplicaLost(f"{missing(r)}: retry", [field_of(r)]) if replica_gone(r) else r
        return results

    async def versions(self) -> dict[str, int]:
        """replica id -> the weight version it serves; raises unless every replica answers."""
        return dict(await self.all("weight_version"))

    async def served(self, expected: int) -> P.WeightsVersion:
        """The version the answering replicas serve (the oldest of them), each one's, and the replicas that did not
        answer; 503 only when none answers."""
        found = await self.survey("weight_version", expected=expected)
        if not found.answers:
            raise ReplicaLost("no engine replica answered (starting or restarting): retry", details(found.problems()))
        replicas = dict(found.answers)
        return P.WeightsVersion(version=min(replicas.values()), replicas=replicas, unreachable=found.problems())

    async def states(self, timeout_s: float = READ_TIMEOUT_S, expected: int = 0) -> Survey:
        return await self.survey("state", expected=expected, timeout_s=timeout_s)

    async def health(self, expected: int) -> P.Health:
        """Every replica samples one token. 503 naming the replica and its error if one that answers cannot, or if
        none answers; replicas that did not answer (dead, restarting) are listed while another one is healthy."""
        found = await self.survey("health", expected=expected)
        if found.failed or not found.answers:
            raise Unavailable("unhealthy: " + "; ".join(found.problems()), details(found.problems()))
        ok = [h for h in found.answers if h.status == "ok"]
        return (ok or found.answers)[0].model_copy(update={"unreachable": found.missing})

    async def control(self, action: str) -> P.ControlResponse:
        """Pause, resume or abort on every replica; their states after it."""
        states = await self.all(action)
        log.info("control", extra={"action": action, "replicas": len(states)})
        return P.ControlResponse(action=action, replicas=states)

    async def readiness(self, expected: int) -> P.Readiness:
        """Ready when every replica answers, none is paused, all serve one weight version, and that one is the
        committed version; else 503 naming the replicas that are missing, paused or behind, or why the committed
        weights cannot be loaded."""
        found = await self.states(expected=expected)
        problems = found.problems() + [f"replica {s.replica} is paused" for s in found.answers if s.paused]
        if len({s.weight_version for s in found.answers}) > 1:
            problems.append("replicas serve different weight versions")
        lost = sorted({s.weights_lost for s in found.answers if s.weights_lost})  # field "weights": until a push
        if problems or lost:
            raise Unavailable("not ready", details(problems) + [{"field": "weights", "message": m} for m in lost])
        return P.Readiness(ready=True, replicas=found.answers)


def details(problems: list[str]) -> list[dict]:
    return [{"field": "replica", "message": m} for m in problems]
