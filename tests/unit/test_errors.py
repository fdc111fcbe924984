"""Errors keep their status, message and detail across Ray, and map to statuses in one place
(rollout_farm/services/api/errors.py). Ray's wrapper for an exception raised in a replica is built here as Ray builds
it, without a cluster."""

import pickle

import pytest
from ray.exceptions import RayTaskError

from rollout_farm.services.engine.bench_engine import BenchEngine
from rollout_farm.services.errors import (
    EngineVerbMissing,
    Invalid,
    NotSupported,
    ReplicaFull,
    ServiceError,
    VersionNotReached,
    as_service_error,
)


@pytest.mark.parametrize(
    "error",
    [
        Invalid([{"field": "prompts.0.token_ids", "message": "out of the vocabulary"}]),
        VersionNotReached("weight version 9 was not committed within FARM_MIN_VERSION_WAIT_S=5"),
        ReplicaFull(),
    ],
)
def test_service_errors_survive_pickling_and_rays_wrapper(error):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and (again.status, again.message, again.detail) == (
        error.status,
        error.message,
        error.detail,
    )
    wrapped = RayTaskError("rollout", "Traceback ...", error).as_instanceof_cause()
    mapped = as_service_error(wrapped)
    assert (mapped.status, mapped.message, mapped.detail) == (error.status, error.message, error.detail)
    assert mapped.retry_after_s == error.retry_after_s


def test_a_missing_engine_verb_is_a_501_with_its_own_message():
    error = EngineVerbMissing.of(BenchEngine(), "NCCL weight transport", "run FARM_ENGINE=sglang on GPUs")
    mapped = as_service_error(RayTaskError("init", "Traceback ...", error).as_instanceof_cause())
    assert isinstance(mapped, NotSupported) and mapped.status == 501
    assert mapped.message == "the BenchEngine engine has no NCCL weight transport: run FARM_ENGINE=sglang on GPUs"


def test_anything_else_is_a_500_that_points_to_the_log():
    for exc in (RuntimeError("boom"), ValueError("a bug"), NotImplementedError("a task method")):
        mapped = as_service_error(exc)
        assert type(mapped) is ServiceError and mapped.status == 500 and "see the service log" in mapped.message
