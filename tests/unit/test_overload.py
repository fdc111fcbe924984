"""Overload and lost replicas at the ingress, without Ray running: the rate-limited warning, Serve's back-pressure
answered in the service's error format (not Serve's plain-text 503), and reads of every replica that name the
replicas that did not answer instead of failing."""

import asyncio
import logging

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from rollout_farm.services import protocol as P
from rollout_farm.services.api import create_api
from rollout_farm.services.errors import QUEUES_FULL, Unavailable
from rollout_farm.services.replica.handle import Replicas
from rollout_farm.services.replica.overload import DropServeBackpressure, RateLimitedWarning


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_limited_warning_writes_one_line_per_kind_per_interval_and_counts_the_rest(caplog):
    logger, clock = logging.getLogger("test.overload"), Clock()
    warn = RateLimitedWarning(logger, every_s=5.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.overload"):
        written = [warn("overloaded", "replica_full", kind="replica_full") for _ in range(7)]
        assert warn("overloaded", "engine_queue", kind="engine_queue")  # another key has its own interval
        clock.now += 4.9
        assert not warn("overloaded", "replica_full", kind="replica_full")
        clock.now += 0.2
        assert warn("overloaded", "replica_full", kind="replica_full", method="rollout")
    assert written == [True] + [False] * 6
    lines = [(r.levelname, r.getMessage(), r.kind, r.suppressed) for r in caplog.records]
    assert lines == [
        ("WARNING", "overloaded", "replica_full", 0),
        ("WARNING", "overloaded", "engine_queue", 0),
        ("WARNING", "overloaded", "replica_full", 7),  # the six of the burst and the one at 4.9 s
    ]
    assert caplog.records[-1].method == "rollout" and not any(r.exc_info for r in caplog.records)


def test_serves_per_request_backpressure_warning_is_dropped_and_nothing_else():
    drop = DropServeBackpressure()

    def record(msg):
        return logging.LogRecord("ray.serve", logging.WARNING, __file__, 1, msg, None, None)

    assert not drop.filter(
        record("Request dropped due to backpressure (num_queued_requests=2, max_queued_requests=2).")
    )
    assert drop.filter(record("Replica at capacity of max_ongoing_requests=6, rejecting request x."))


def app_with_failing_routes(api: FastAPI) -> TestClient:
    """The app with Serve's handlers added afterwards, as the Serve replica adds them, and two routes that raise
    Serve's errors."""

    def serve_handler(request, exc):  # what Serve registers: a plain-text 503 without Retry-After
        from starlette.responses import Response

        return Response(str(exc), status_code=503)

    api.add_exception_handler(BackPressureError, serve_handler)
    api.add_exception_handler(DeploymentUnavailableError, serve_handler)

    @api.get("/backpressure")
    async def backpressure():
        raise BackPressureError(num_queued_requests=2, max_queued_requests=2)

    @api.get("/unavailable")
    async def unavailable():
        raise DeploymentUnavailableError(deployment_id="engine")

    return TestClient(api)


def test_serve_back_pressure_past_the_handle_is_our_429_with_retry_after():
    client = app_with_failing_routes(create_api())
    r = client.get("/backpressure")
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json() == {"error": QUEUES_FULL, "detail": []}
    r = client.get("/unavailable")
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "no engine replica" in r.json()["error"]


def test_without_our_app_class_serves_handler_would_answer_plain_text_503():
    """The negative control: on a plain FastAPI app, Serve's handler (registered last) wins."""
    client = app_with_failing_routes(FastAPI())
    r = client.get("/backpressure")
    assert r.status_code == 503 and "retry-after" not in r.headers
    assert r.text.startswith("Request dropped due to backpressure")


class Broadcast:
    def __init__(self, results):
        self.results = results

    async def results_async(self, timeout_s, return_exceptions):
        if isinstance(self.results, BaseException):
            raise self.results
        return self.results


class Handle:
    """A Serve handle whose broadcasts answer fixed results per method."""

    def __init__(self, **by_method):
        self.by_method = by_method

    def broadcast(self, method, *args):
        return Broadcast(self.by_method[method])


def died(replica: str) -> RayActorError:
    return RayActorError(
        error_msg=f"The actor died unexpectedly before finishing this task.\n\tname: SERVE_REPLICA::farm#engine#"
        f"{replica}\nThe actor is dead because it was killed by `ray.kill`."
    )


def health(replica: str, status: str = "ok") -> P.Health:
    return P.Health(status=status, weight_version=3, generated_token_id=7, replica=replica)


def run(coro):
    return asyncio.run(coro)


def test_health_is_ok_while_one_replica_is_dead_and_names_it():
    h = run(Replicas(Handle(health=[health("a"), died("b2")])).health(expected=2))
    assert h.status == "ok" and h.replica == "a"
    assert h.unreachable == [
        "replica b2 did not answer: RayActorError (The actor is dead because it was killed by `ray.kill`.)"
    ]
    h = run(Replicas(Handle(health=[health("a")])).health(expected=2))  # Serve has dropped the dead one already
    assert h.status == "ok" and h.unreachable == ["1 of FARM_REPLICAS=2 replicas not running: starting or restarting"]


def test_health_is_503_naming_a_replica_that_cannot_sample():
    broken = Unavailable("replica b cannot sample: RuntimeError: probability tensor contains either inf, nan")
    wrapped = RayTaskError("health", "Traceback ...", broken).as_instanceof_cause()
    with pytest.raises(Unavailable) as e:
        run(Replicas(Handle(health=[health("a"), wrapped])).health(expected=2))
    assert e.value.status == 503 and e.value.detail == [{"field": "replica", "message": broken.message}]
    with pytest.raises(Unavailable) as e:  # and when none answers at all
        run(Replicas(Handle(health=DeploymentUnavailableError(deployment_id="engine"))).health(expected=2))
    assert "no engine replica is running" in e.value.message


def test_versions_readiness_and_states_name_the_missing_replica_instead_of_failing():
    replicas = Replicas(
        Handle(
            weight_version=[("a", 4), died("b2")],
            state=[P.ReplicaState(replica="a", weight_version=4, paused=False), died("b2")],
        )
    )
    v = run(replicas.served(expected=2))
    assert v.version == 4 and v.replicas == {"a": 4} and len(v.unreachable) == 1 and "replica b2" in v.unreachable[0]
    with pytest.raises(Unavailable) as e:
        run(replicas.readiness(expected=2))
    assert e.value.message == "not ready" and "replica b2" in e.value.detail[0]["message"]
    states = run(replicas.states())
    assert [s.replica for s in states.answers] == ["a"] and "replica b2" in states.missing[0]
    timed_out = Replicas(Handle(weight_version=TimeoutError()))
    with pytest.raises(Unavailable) as e:  # no replica at all: an honest 503, not a 500
        run(timed_out.served(expected=2))
    assert "within 30 s" in e.value.detail[0]["message"]


class Response:
    """A DeploymentResponse that answers `outcome` (raised if it is an exception)."""

    def __init__(self, outcome):
        self.outcome = outcome

    def __await__(self):
        async def answer():
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

        return answer().__await__()


def counted(kind: str) -> float:
    from rollout_farm.services.observability import metrics

    return metrics.OVERLOAD.labels(kind)._value.get()


def test_a_replicas_full_answer_and_serves_back_pressure_are_counted_429s_and_a_dead_replica_a_503():
    from rollout_farm.services.errors import Overloaded, ReplicaFull, ReplicaLost
    from rollout_farm.services.replica.handle import ReplicaCall
    from rollout_farm.services.replica.overload import Full

    full, queue = counted("replica_full"), counted("engine_queue")
    with pytest.raises(ReplicaFull) as e:
        run(ReplicaCall(Response(Full(2)), "rollout")._result())
    assert e.value.status == 429 and e.value.retry_after_s == 1 and counted("replica_full") == full + 1
    with pytest.raises(Overloaded) as e:
        run(ReplicaCall(Response(BackPressureError(2, 2)), "rollout")._result())
    assert e.value.message == QUEUES_FULL and counted("engine_queue") == queue + 1
    with pytest.raises(ReplicaLost) as e:
        run(ReplicaCall(Response(died("c3")), "vocab_size")._result())
    assert e.value.status == 503 and e.value.retry_after_s == 1 and "replica c3" in e.value.detail[0]["message"]
    assert run(ReplicaCall(Response([1, 2]), "rollout")._result()) == [1, 2]  # an answer is just returned
    assert (counted("replica_full"), counted("engine_queue")) == (full + 1, queue + 1)
