"""The HTTP surface as a whole: health, metrics and docs, body limits, the error shape of unknown paths."""

import httpx
import pytest

from rollout_farm.services import protocol as P
from tests import metrics_text
from tests.service.helpers import metric, request


def test_health_metrics_and_docs(service, client, fresh_weights):
    """Health, the rollout counters, the gauges and histograms, the docs. The per-sampler counters are read before the
    rollout and their increase asserted: the service exports them at 0 from its start, so the first read needs no
    earlier rollout and the test passes alone and in any order."""
    h = client.health()
    assert h.status == "ok" and h.generated_token_id >= 0
    samples, groups = (
        metric(service, "farm_samples_total", sampler="plain"),
        metric(service, "farm_groups_total", sampler="plain"),
    )
    client.rollouts(P.RolloutRequest.model_validate(request(n=2)))
    assert (
        metric(service, "farm_samples_total", sampler="plain") == samples + 6
        and metric(service, "farm_groups_total", sampler="plain") == groups + 3
    )
    assert metric(service, "farm_weight_version") == fresh_weights
    assert (
        metric(service, "farm_generated_tokens_total", sampler="plain") > 0
        and metric(service, "farm_weight_sync_bytes_total") > 0
    )
    text = httpx.get(f"{service}/metrics").text
    replica_versions = [v for _, v in metrics_text.samples(text, "farm_replica_weight_version")]
    assert replica_versions == [fresh_weights, fresh_weights]  # both replicas, each labelled
    assert "farm_trajectory_staleness_versions_bucket" in text
    assert 'farm_request_seconds_bucket{le="0.01",path="/v1/rollouts"}' in httpx.get(f"{service}/metrics").text
    assert httpx.get(f"{service}/docs").status_code == 200
    spec = httpx.get(f"{service}/openapi.json").json()
    assert {"/v1/rollouts", "/v1/weights", "/v1/weights/version", "/healthz", "/metrics"} <= set(spec["paths"])


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_json_bodies_get_413(service, chunked):
    from rollout_farm.services.api.middleware import MAX_REQUEST_BYTES

    body = b'{"prompts": [{"text": "' + b"x" * MAX_REQUEST_BYTES + b'"}]}'
    content = (
        iter([body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)]) if chunked else body
    )  # no Content-Length when chunked
    r = httpx.post(f"{service}/v1/rollouts", content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "fewer prompts" in r.json()["error"]


def test_unknown_paths_get_the_error_shape(service):
    r = httpx.get(f"{service}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]
