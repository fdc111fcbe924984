"""GET /metrics on any ingress replica merges every replica's: counters and histograms summed, gauges from the
answering replica (whose state gauges were read from Redis just then)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rollout_farm.services.observability.metrics import merged


def replica_text(requests: int, version: int, seconds: list[float]) -> str:
    reg = CollectorRegistry()
    Counter("farm_requests_total", "HTTP requests", ["path"], registry=reg).labels("/v1/rollouts").inc(requests)
    Gauge("farm_weight_version", "committed", registry=reg).set(version)
    hist = Histogram("farm_request_seconds", "latency", buckets=(0.1, 1.0), registry=reg)
    for s in seconds:
        hist.observe(s)
    return generate_latest(reg).decode()


def test_counters_and_histograms_sum_and_gauges_come_from_the_answering_replica():
    texts = {"a": replica_text(3, 7, [0.05]), "b": replica_text(5, 6, [0.5, 2.0])}
    out = merged(texts, me="a").decode()
    assert 'farm_requests_total{path="/v1/rollouts"} 8.0' in out
    assert "farm_weight_version 7.0" in out and "farm_weight_version 6.0" not in out
    assert 'farm_request_seconds_bucket{le="0.1"} 1.0' in out and 'farm_request_seconds_bucket{le="1.0"} 2.0' in out
    assert "farm_request_seconds_count 3.0" in out
    assert "farm_weight_version 6.0" in merged(texts, me="b").decode()  # the other replica answering
