"""Every metric the Grafana dashboard and the alert rules query from the service exists in the real service's
/metrics: a rollout, a queue source with a pull and an ack, and a weight push go through the real API first, then
the scrape is parsed (prometheus_client's parser) and each name the PromQL selects (promql-parser) is looked up.
The trainer's names (farm_trainer_*) are checked against a real `farm train`: tests/e2e/test_trainer_metrics.py."""

import copy

import httpx
import pytest
import yaml

import tests.farm_plugins  # noqa: F401  (the service's FARM_PLUGINS: its samplers and tool formats registered here too)
from rollout_farm.services.chat.tool_formats import TOOL_FORMATS
from rollout_farm.services.extensions.samplers import SAMPLERS
from tests.deploy.monitoring import ALERTS, exported, missing, queried
from tests.metrics_text import by_label
from tests.service.helpers import AUTH, request, rollout

SOURCE = "monitoring-q"
SHORT = {"max_new_tokens": 8, "temperature": 1.0}


def scrape(service: str) -> str:
    r = httpx.get(f"{service}/metrics", timeout=60)
    assert r.status_code == 200, r.text
    return r.text


def drive(service: str, client, tiny_model) -> None:
    """Traffic that touches every part the dashboard shows: rollouts, the queue, a session, a weight push."""
    assert rollout(service, request(n=2)).status_code == 200
    spec = {"name": SOURCE, "dataset": "arith", "n": 2, "target_groups": 2, "sampling_params": SHORT}
    assert httpx.post(f"{service}/v1/queue/sources", json=spec, headers=AUTH, timeout=30).status_code == 200
    pulled = httpx.post(
        f"{service}/v1/queue/pull", json={"source": SOURCE, "max_groups": 1, "wait_s": 60}, headers=AUTH, timeout=120
    )
    assert pulled.status_code == 200 and pulled.json()["items"], pulled.text
    ids = [i["item_id"] for i in pulled.json()["items"]]
    assert httpx.post(f"{service}/v1/queue/ack", json={"item_ids": ids}, headers=AUTH, timeout=30).status_code == 200
    assert httpx.post(f"{service}/v1/sessions", json={}, timeout=30).status_code == 200  # the tool-call series
    version = client.weights_version().version + 1
    client.push_weights((tiny_model / "model.safetensors").read_bytes(), version)


@pytest.fixture(scope="module")
def text(service, tiny_model):
    """The scrape after the traffic, taken while the queue source exists."""
    from rollout_farm.services.client import FarmClient
    from tests.conftest import TOKEN

    try:
        with FarmClient(service, TOKEN, retries=0) as client:
            drive(service, client, tiny_model)
        return scrape(service)
    finally:
        httpx.delete(f"{service}/v1/queue/sources/{SOURCE}", headers=AUTH, timeout=30)


def test_every_service_metric_the_dashboard_and_alerts_query_is_exported(text):
    names = queried(trainer=False)
    assert len(names) >= 15  # the extraction found the queries
    assert {n: sorted(names[n]) for n in missing(names, text)} == {}
    have = exported(text)
    assert have["farm_request_seconds_bucket"] == have["farm_trajectory_staleness_versions_bucket"] == "histogram"


def test_labelled_counters_are_exported_at_zero_before_they_count(service):
    """A 429 kind, a queue source's redeliveries, every registered sampler's and tool format's counters (the
    service's FARM_PLUGINS, tests.farm_plugins, included), the filter's outcomes, exist at 0 before the first one:
    rate() and the alerts need a series from the start. It holds whatever ran before, so it needs no order."""
    spec = {"name": "monitoring-zero", "dataset": "arith", "n": 1, "target_groups": 1, "sampling_params": SHORT}
    assert httpx.post(f"{service}/v1/queue/sources", json=spec, headers=AUTH, timeout=30).status_code == 200
    try:
        text = scrape(service)
    finally:
        httpx.delete(f"{service}/v1/queue/sources/monitoring-zero", headers=AUTH, timeout=30)
    for kind in ("replica_full", "engine_queue"):
        assert f'farm_overload_rejections_total{{kind="{kind}"}}' in text
    for counter in ("redeliveries_total", "stale_dropped_total", "acked_total", "generated_groups_total"):
        assert f'farm_queue_{counter}{{source="monitoring-zero"}}' in text
    for name in ("samples", "generated_tokens", "zero_variance_groups", "groups", "sampler_candidates"):
        assert set(SAMPLERS.names()) <= set(by_label(text, f"farm_{name}_total", "sampler")), name
    assert set(SAMPLERS.names()) <= set(by_label(text, "farm_sampler_rejected_total", "sampler"))
    for name in ("farm_tool_calls_total", "farm_tool_parse_errors_total"):  # the plugin's test_wrong_tag included
        assert set(TOOL_FORMATS.names()) <= set(by_label(text, name, "format")), name
    assert set(by_label(text, "farm_filter_groups_total", "outcome")) >= {"kept", "zero_variance", "surplus"}


def test_a_misspelled_metric_in_a_rule_is_reported_missing(text):
    """The negative control: the same check on a copy of the rules with one name misspelled names it."""
    rules = yaml.safe_load(ALERTS.read_text())
    broken = copy.deepcopy(rules)
    rule = next(r for r in broken["groups"][0]["rules"] if r["alert"] == "FarmQueueStarvingTrainer")
    rule["expr"] = rule["expr"].replace("farm_queue_ready_groups", "farm_queue_redy_groups")
    names = queried(trainer=False, rules=broken)
    assert missing(names, text) == {"farm_queue_redy_groups"}
    assert names["farm_queue_redy_groups"] == {"alert FarmQueueStarvingTrainer"}
