"""The Grafana dashboard, the Prometheus alert rules and scrape config, and Grafana's provisioning, checked as
files: structure, PromQL that parses, the panels and alerts the issue asks for, and every file the chart and
compose reference present. (That each queried metric exists: tests/service/test_monitoring_metrics.py and
tests/e2e/test_trainer_metrics.py.)"""

import re

import promql_parser
import pytest
import yaml

from tests.deploy.monitoring import ALERTS, DASHBOARD, ROOT, alert_rules, dashboard, metric_names, panels, queries

DS = {"type": "prometheus", "uid": "${datasource}"}
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana" / "provisioning"
CHART = ROOT / "helm" / "rollout-farm"
# what the issue asks the dashboard to show, as the metrics that show it
SHOWN = {
    "weight version per replica": "farm_replica_weight_version",
    "staleness histogram": "farm_trajectory_staleness_versions_bucket",
    "queue depth": "farm_queue_ready_groups",
    "leases": "farm_queue_leased_groups",
    "redeliveries": "farm_queue_redeliveries_total",
    "samples/s per sampler": "farm_samples_total",
    "tokens/s per sampler": "farm_generated_tokens_total",
    "zero-variance group fraction": "farm_zero_variance_groups_total",
    "weight-sync seconds": "farm_weight_sync_seconds_bucket",
    "request latency": "farm_request_seconds_bucket",
    "429 rate": "farm_requests_total",
    "reward mean": "farm_trainer_reward_mean",
    "reward std": "farm_trainer_reward_std",
    "KL": "farm_trainer_kl_ref",
    "KL coefficient": "farm_trainer_kl_coef",
    "guard actions": "farm_trainer_guard_actions_total",
    "step seconds": "farm_trainer_step_seconds",
    "rollout idle ratio (engine busy)": "farm_replica_busy_seconds",
    "engine batch size": "farm_engine_batch_size_bucket",
    "rollouts waiting per replica": "farm_replica_rollouts_waiting",
    "trainer idle ratio": "farm_trainer_trainer_idle_ratio",
    "rollout idle ratio (queue source)": "farm_trainer_rollout_idle_ratio",
    "trainer sample staleness": "farm_trainer_sample_staleness_versions_bucket",
    "off-policy corrected samples": "farm_trainer_offpolicy_fraction",
    "session turns": "farm_session_turns_total",
    "session forks": "farm_session_forks_total",
    "tool calls": "farm_tool_calls_total",
    "tool parse errors": "farm_tool_parse_errors_total",
    "token refusals": "farm_session_token_refusals_total",
    "episodes by stop reason": "farm_episodes_total",
    "environment step latency": "farm_env_step_seconds_bucket",
}
ALERTED = {
    "FarmReplicaWeightVersionsDiffer": {"farm_replica_weight_version"},
    "FarmHighStaleness": {"farm_trajectory_staleness_versions_bucket"},
    "FarmSustained429s": {"farm_requests_total"},
    "FarmKLGuardRollback": {"farm_trainer_guard_actions_total"},
    "FarmQueueStarvingTrainer": {"farm_queue_ready_groups", "farm_trainer_step"},
}


def test_the_dashboard_is_plain_grafana_with_a_datasource_variable_and_rows():
    d = dashboard()
    assert d["uid"] == "rollout-farm" and d["schemaVersion"] >= 39 and d["title"]
    (var,) = [v for v in d["templating"]["list"] if v["name"] == "datasource"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    assert [p["title"] for p in d["panels"] if p["type"] == "row"] == [
        "Service",
        "Queue",
        "Weights",
        "Trainer",
        "Batching and overlap",
        "Agent sessions",
    ]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine


@pytest.mark.parametrize("panel", panels(dashboard()), ids=lambda p: p["title"])
def test_every_panel_queries_prometheus_through_the_variable_with_a_unit(panel):
    assert panel["type"] in {"timeseries", "stat", "heatmap"} and panel["description"]
    assert panel["datasource"] == DS and panel["targets"]
    for t in panel["targets"]:
        assert t["datasource"] == DS and t["expr"].strip() and t["refId"]
    assert panel["fieldConfig"]["defaults"]["unit"]


def test_units_fit_what_is_shown():
    unit = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in panels(dashboard())}
    assert unit["Request latency p50 / p99"] == unit["Weight-sync seconds"] == unit["Step seconds"] == "s"
    assert unit["Zero-variance group fraction"] == "percentunit"
    assert unit["Samples/s per sampler"] == unit["Tokens/s per sampler"] == "ops" and unit["429 rate"] == "reqps"


@pytest.mark.parametrize("where, expr", queries().items())
def test_every_query_is_promql_that_selects_farm_metrics(where, expr):
    names = metric_names(expr)
    assert names and all(n.startswith("farm_") for n in names), (where, names)


def test_the_dashboard_shows_what_the_issue_asks_for():
    shown = set().union(*(metric_names(e) for w, e in queries().items() if w.startswith("panel ")))
    assert {what: m for what, m in SHOWN.items() if m not in shown} == {}


def test_each_alert_rule_has_a_duration_severity_summary_and_description():
    rules = alert_rules()
    assert {r["alert"]: metric_names(r["expr"]) >= ALERTED[r["alert"]] for r in rules} == dict.fromkeys(ALERTED, True)
    for r in rules:
        assert promql_parser.parse_duration(r["for"]).total_seconds() > 0, r["alert"]
        assert r["labels"]["severity"] in {"warning", "critical"}, r["alert"]
        assert len(r["annotations"]["summary"]) > 10 and len(r["annotations"]["description"]) > 80, r["alert"]
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]


def test_name_extraction_skips_functions_keywords_labels_and_grouping():
    expr = (
        'sum by (job, le) (rate(a_bucket{status="429", le!~"b_total"}[5m])) / on (job) group_left '
        'max without (replica) (b offset 5m) or on () vector(0) unless {__name__="c_total"} and absent(d)'
    )
    assert metric_names(expr) == {"a_bucket", "b", "c_total", "d"}
    with pytest.raises(ValueError):
        metric_names("rate(farm_requests_total[5m]")


def test_prometheus_scrapes_the_service_ray_and_the_trainer_and_loads_the_rules():
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    assert cfg["rule_files"] == ["/etc/prometheus/alerts.yaml"]
    jobs = {
        j["job_name"]: (j["static_configs"][0]["targets"], j.get("metrics_path", "/metrics"))
        for j in cfg["scrape_configs"]
    }
    assert jobs == {
        "service": (["farm:8000"], "/metrics"),
        "ray": (["farm:8080"], "/metrics"),
        "trainer": (["trainer:9100"], "/metrics"),
    }


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard_folder():
    (ds,) = yaml.safe_load((GRAFANA / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert (ds["type"], ds["uid"], ds["url"], ds["isDefault"]) == (
        "prometheus",
        "prometheus",
        "http://prometheus:9090",
        True,
    )
    (provider,) = yaml.safe_load((GRAFANA / "dashboards" / "rollout-farm.yaml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/etc/grafana/dashboards"


def test_the_files_the_chart_and_compose_reference_exist():
    assert DASHBOARD.is_file() and ALERTS.is_file() and PROMETHEUS.is_file()
    templates = "".join(p.read_text() for p in (CHART / "templates").rglob("*") if p.is_file())
    referenced = [CHART / f for f in re.findall(r'\.Files\.Get\s+"([^"]+)"', templates)]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith("."):
                referenced.append(ROOT / source)
    assert [p for p in referenced if not p.exists()] == []
