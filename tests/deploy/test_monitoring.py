"""The Grafana dashboard, the Prometheus alert rules and scrape config, and Grafana's provisioning, checked as
files: structure, PromQL that parses, the panels and alerts the issue asks for, alerts that fire when a target is
down rather than going silent, no rate() over a gauge, the dashboard's namespace and job filters, and every file the
chart and compose reference present. (That each queried farm metric exists: tests/service/test_monitoring_metrics.py
and tests/e2e/test_trainer_metrics.py; Ray's: against the installed Ray's source, here.)"""

import re

import promql_parser
import pytest
import yaml

from tests.deploy.chart_render import BASE, merged, render
from tests.deploy.monitoring import (
    ALERTS,
    DASHBOARD,
    FARM_PREFIX,
    JOBS,
    OTHER_METRICS,
    RANGE_OVER_COUNTERS,
    RANGE_OVER_GAUGES,
    RAY_METRICS,
    ROOT,
    TRAINER_PREFIX,
    alert_rules,
    dashboard,
    farm_metric_types,
    matcher,
    metric_names,
    metric_types,
    panels,
    queries,
    range_calls,
    ray_definition_errors,
    selectors,
)

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
    "scrape targets up": "up",
    "Serve replica health": "ray_serve_deployment_replica_healthy",
    "Serve deployment status": "ray_serve_deployment_status",
    "Serve requests through Ray's counter": "ray_serve_num_http_requests_total",
    "Ray node CPU": "ray_node_cpu_utilization",
    "Ray GPU utilization": "ray_node_gpus_utilization",
    "head restarts": "kube_pod_container_status_restarts_total",
    "Redis ready": "kube_deployment_status_replicas_available",
    "DCGM GPU utilization": "DCGM_FI_DEV_GPU_UTIL",
    "DCGM framebuffer used": "DCGM_FI_DEV_FB_USED",
}
ALERTED = {
    "FarmReplicaWeightVersionsDiffer": {"farm_replica_weight_version"},
    "FarmHighStaleness": {"farm_trajectory_staleness_versions_bucket"},
    "FarmSustained429s": {"farm_requests_total"},
    "FarmKLGuardRollback": {"farm_trainer_guard_actions_total"},
    "FarmQueueStarvingTrainer": {"farm_queue_ready_groups", "farm_trainer_step"},
    "FarmServiceDown": {"up"},
    "FarmServiceMetricsAbsent": {"up"},
    "FarmServiceTargetGone": {"up"},
    "FarmTrainerDown": {"up"},
    "FarmRayMetricsDown": {"up"},
    "FarmRayMetricsAbsent": {"up"},
    "FarmRayTargetGone": {"up"},
    "FarmServeDeploymentUnhealthy": {"ray_serve_deployment_status"},
    "FarmServeNoHealthyReplica": {"ray_serve_deployment_replica_healthy"},
    "FarmServeReplicaUnhealthy": {"ray_serve_deployment_replica_healthy"},
    "FarmRayHeadRestarted": {"kube_pod_container_status_restarts_total", "up"},
    "FarmRedisUnavailable": {"kube_deployment_status_replicas_available", "up"},
    "FarmKubeStateMetricsMissing": {"kube_pod_info", "up"},
}


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags (`!reset`, `!override`) read as their plain values."""


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(
        _tag,
        lambda loader, node: (
            loader.construct_sequence(node)
            if isinstance(node, yaml.SequenceNode)
            else loader.construct_mapping(node)
            if isinstance(node, yaml.MappingNode)
            else loader.construct_scalar(node)
        ),
    )
# The targets a metric name is scraped from; the targets a rule needs an `absent` rule for (the trainer is optional:
# no trainer is not an outage, and a finished Job's Pod leaves the targets).
TARGET_OF = (("farm_trainer_", "trainer"), ("farm_", "service"), ("ray_", "ray"), ("kube_", "kube-state-metrics"))
REQUIRED = {"service", "ray"}
ROWS = [
    "Health",
    "Service",
    "Queue",
    "Weights",
    "Trainer",
    "Batching and overlap",
    "Agent sessions",
    "Tenants",
    "Ray (:8080)",
    "GPUs (DCGM)",
]


def test_the_dashboard_is_plain_grafana_with_a_datasource_variable_and_rows():
    d = dashboard()
    assert d["uid"] == "rollout-farm" and d["schemaVersion"] >= 39 and d["title"]
    (var,) = [v for v in d["templating"]["list"] if v["name"] == "datasource"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    assert [p["title"] for p in d["panels"] if p["type"] == "row"] == ROWS
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
def test_every_query_is_promql_that_selects_known_metrics(where, expr):
    """The farm's names, Ray's (each checked against the installed Ray below), `up`, kube-state-metrics' and DCGM's."""
    names = metric_names(expr)
    assert names and all(n.startswith(FARM_PREFIX) or n in RAY_METRICS or n in OTHER_METRICS for n in names), (
        where,
        names,
    )


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


COMPOSE_FILES = ("docker-compose.yml", "deploy/compose.host.yml")


def compose_file(path):
    """A compose file as YAML, compose's own tags (!reset, !override) read as their plain values."""

    class Loader(yaml.SafeLoader):
        pass

    def plain(loader, _tag, node):
        if isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node, deep=True)
        if isinstance(node, yaml.MappingNode):
            return loader.construct_mapping(node, deep=True)
        return loader.construct_scalar(node)

    Loader.add_multi_constructor("!", plain)
    return yaml.load(path.read_text(), Loader=Loader)


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard_folder():
    (ds,) = yaml.safe_load((GRAFANA / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert (ds["type"], ds["uid"], ds["url"], ds["isDefault"]) == (
        "prometheus",
        "prometheus",
        "${PROMETHEUS_URL}",
        True,
    )
    # Grafana expands ${VAR} in provisioning files from its environment: compose's name, or loopback on the host network
    compose, host = (compose_file(ROOT / name)["services"]["grafana"]["environment"] for name in COMPOSE_FILES)
    assert compose["PROMETHEUS_URL"] == "http://prometheus:9090"
    assert host["PROMETHEUS_URL"] == "http://127.0.0.1:${PROMETHEUS_PORT:-9090}"
    (provider,) = yaml.safe_load((GRAFANA / "dashboards" / "rollout-farm.yaml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/etc/grafana/dashboards"


def test_the_files_the_chart_and_compose_reference_exist():
    assert DASHBOARD.is_file() and ALERTS.is_file() and PROMETHEUS.is_file()
    templates = "".join(p.read_text() for p in (CHART / "templates").rglob("*") if p.is_file())
    referenced = [CHART / f for f in re.findall(r'\.Files\.Get\s+"([^"]+)"', templates)]
    compose = yaml.load((ROOT / "docker-compose.yml").read_text(), Loader=ComposeLoader)
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith("."):
                referenced.append(ROOT / source)
    assert [p for p in referenced if not p.exists()] == []


# --- Alerts that fire when the farm is down, not go silent -----------------------------------------------------


def target_of(name: str) -> str | None:
    return next((target for prefix, target in TARGET_OF if name.startswith(prefix)), None)


def job_target(selector) -> str | None:
    """The farm target whose compose and chart job names a selector's job matcher both match (None if none)."""
    m = matcher(selector, "job")
    if m is None:
        return None
    pattern = m.value if m.op == promql_parser.MatchOp.Re else re.escape(m.value)
    both = [t for t, names in JOBS.items() if all(re.fullmatch(pattern, n) for n in names)]
    return both[0] if len(both) == 1 else None


def watched(expr: str) -> tuple[set[str], set[str], bool]:
    """What a rule watches: the targets it has `up{job} == 0` for, those it has `absent(up{job})` for, and whether it
    is a guard on kube-state-metrics (`... unless <kube_* series>`)."""
    down, absent, guard = set(), set(), False

    def visit(node):
        nonlocal guard
        if isinstance(node, promql_parser.BinaryExpr):
            op = str(node.op)
            if (
                op == "=="
                and isinstance(node.lhs, promql_parser.VectorSelector)
                and node.lhs.name == "up"
                and isinstance(node.rhs, promql_parser.NumberLiteral)
                and node.rhs.val == 0
            ):
                down.add(job_target(node.lhs))
            if op == "unless" and any(n.startswith("kube_") for n in metric_names(node.rhs.prettify())):
                guard = True
        if isinstance(node, promql_parser.Call) and node.func.name == "absent":
            (arg,) = node.args
            if isinstance(arg, promql_parser.VectorSelector) and arg.name == "up":
                absent.add(job_target(arg))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return down - {None}, absent - {None}, guard


@pytest.mark.parametrize("group", yaml.safe_load(ALERTS.read_text())["groups"], ids=lambda g: g["name"])
def test_every_alert_group_alerts_when_the_targets_it_reads_are_down_or_absent(group):
    """A rule over a target's metrics is silent when that target is down (no data never fires). So each group has,
    for every target its rules read, a rule on `up{job=...} == 0` (the service, Ray's port and the trainer), an
    `absent(up{job=...})` rule (the service and Ray; the trainer is optional), and, where it reads
    kube-state-metrics, a rule that fires when kube-state-metrics reports nothing (`... unless kube_*`). The job
    matcher must match both compose's and the chart's job name of the target. Fails on the old rules: group
    rollout-farm read the service and the trainer with no rule on `up` at all."""
    read = {target_of(n) for r in group["rules"] for n in metric_names(r["expr"])} - {None}
    down, absent, guard = set(), set(), False
    for r in group["rules"]:
        d, a, g = watched(r["expr"])
        down, absent, guard = down | d, absent | a, guard or g
    assert read
    assert {t for t in read if t in JOBS} - down == set(), "no `up == 0` rule"
    assert {t for t in read if t in REQUIRED} - absent == set(), "no `absent(up)` rule"
    assert guard or "kube-state-metrics" not in read, "no rule for kube-state-metrics missing"


def test_the_target_checks_see_a_missing_rule():
    """The negative control: without FarmServiceDown the service is not watched, and a job matcher that names only
    compose's job (not the chart's) watches nothing."""
    rules = [r for r in alert_rules() if r["alert"] != "FarmServiceDown"]
    assert "service" not in set().union(*(watched(r["expr"])[0] for r in rules))
    assert watched('up{job="service"} == 0') == (set(), set(), False)
    assert watched('up{job=~"service|rollout-farm-service"} == 0')[0] == {"service"}


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_every_alert_selects_its_job_and_keeps_the_namespace(rule):
    """Each farm_* or ray_* selector names its target's job (compose's and the chart's name, so one rule file serves
    both and another team's Ray or `service` job is not read), each `up` selector a farm job, and every aggregation
    keeps `namespace` (two releases alert apart). Fails on the old rules: no job matchers; `by (job)` and `on ()`."""
    for s in selectors(rule["expr"]):
        target = target_of(s.name) if s.name.startswith((FARM_PREFIX, "ray_")) else None
        if target:
            assert job_target(s) == target, (s.name, matcher(s, "job"))
        if s.name == "up":
            m = matcher(s, "job")
            assert m is not None and any(re.fullmatch(m.value, n) for names in JOBS.values() for n in names), m

    def visit(node):
        if isinstance(node, promql_parser.AggregateExpr):
            mod = node.modifier
            assert mod is not None, f"{rule['alert']}: {node.prettify()} drops namespace"
            keeps = "namespace" in mod.labels
            assert keeps == (mod.type == promql_parser.AggModifierType.By), f"{rule['alert']}: {node.prettify()}"

    promql_parser.walk(promql_parser.parse(rule["expr"]), visit)


def test_compose_and_the_chart_scrape_the_jobs_the_rules_and_dashboard_select():
    """Compose's Prometheus job names and the chart's monitors' `job` relabelings are JOBS's two names. Fails on the
    old templates: the monitors left Prometheus Operator's job names (<release>-serve-svc, <namespace>/<monitor>)."""
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    assert {j["job_name"] for j in cfg["scrape_configs"]} == {compose for compose, _ in JOBS.values()}
    values = {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}
    for head_only in (True, False):
        values["serviceMonitor"]["headOnly"] = head_only
        docs = render(merged(BASE, {"monitoring": values, "trainer": {"enabled": True}}))
        endpoints = {
            d["metadata"]["name"].rsplit("-", 1)[-1] if d["kind"] == "PodMonitor" else "service": (
                d["spec"].get("endpoints") or d["spec"]["podMetricsEndpoints"]
            )
            for d in docs
            if d["kind"] in ("ServiceMonitor", "PodMonitor")
        }
        assert set(endpoints) == set(JOBS)
        for target, (endpoint,) in endpoints.items():
            jobs = [r["replacement"] for r in endpoint["relabelings"] if r.get("targetLabel") == "job"]
            assert jobs == [JOBS[target][1]], target


# --- No rate() over a gauge -----------------------------------------------------------------------------------------


def type_errors(expr: str) -> list[str]:
    types = metric_types()
    errors = [f"{n}: no known type" for n in metric_names(expr) if n not in types]
    for func, name in range_calls(expr):
        if func in RANGE_OVER_COUNTERS and types.get(name) != "counter":
            errors.append(f"{func}({name}): {name} is a {types.get(name)}, not a counter")
        if func in RANGE_OVER_GAUGES and types.get(name) != "gauge":
            errors.append(f"{func}({name}): {name} is a {types.get(name)}, not a gauge")
    return errors


@pytest.mark.parametrize("where, expr", queries().items())
def test_no_counter_function_over_a_gauge(where, expr):
    """rate(), irate(), increase() and resets() only over counters (a counter's _total, a histogram's _bucket, _sum
    and _count); deriv(), delta(), idelta() and predict_linear() only over gauges. Types from the code (the
    service's registry and exposition(), the queue's, the trainer's), Ray's list (checked against the installed Ray
    below) and the exporters'. Fails on the old dashboard: rate(farm_replica_busy_seconds), a gauge (read from each
    replica at scrape time)."""
    assert type_errors(expr) == [], where


def test_the_type_check_sees_a_counter_function_over_a_gauge():
    """The negative control, with the types from the code."""
    assert type_errors("rate(farm_replica_busy_seconds[5m])") != []
    assert type_errors("max(farm_queue_ready_groups) - deriv(farm_requests_total[5m])") != []
    assert type_errors("rate(ray_serve_num_http_requests[5m])") != []  # Ray's deprecated gauge twin of a counter
    assert type_errors("deriv(farm_replica_busy_seconds[5m]) + rate(farm_request_seconds_bucket[5m])") == []


def test_farm_metric_types_come_from_the_code():
    types = farm_metric_types()
    assert types["farm_requests_total"] == types["farm_request_seconds_bucket"] == "counter"
    assert (
        types["farm_trainer_guard_actions_total"] == types["farm_trainer_sample_staleness_versions_bucket"] == "counter"
    )
    gauges = ("farm_replica_busy_seconds", "farm_queue_ready_groups", "farm_weight_version", "farm_trainer_step")
    assert {types[g] for g in gauges} == {"gauge"}
    assert all(n.startswith(FARM_PREFIX) for n in types) and any(n.startswith(TRAINER_PREFIX) for n in types)


def test_ray_metrics_are_what_the_installed_ray_defines():
    """Each Ray name the dashboard and rules use is made, with the type listed, in the installed Ray (2.60): a
    renamed or retyped metric in a Ray upgrade fails here. Negative control: a wrong type and a name Ray lacks."""
    assert ray_definition_errors() == {}
    bad = {
        "ray_serve_deployment_status": ("counter",) + RAY_METRICS["ray_serve_deployment_status"][1:],
        "ray_serve_replica_healthy": ("gauge",) + RAY_METRICS["ray_serve_deployment_replica_healthy"][1:2] + ("x",),
    }
    assert set(ray_definition_errors(bad)) == set(bad)


# --- The dashboard's namespace and job filters ---------------------------------------------------------------


def test_the_dashboard_has_namespace_and_job_variables():
    """Query variables on the datasource, multi-valued with All: namespace (All matches series without one, as in
    compose) and job (All is the farm's jobs, compose's and the chart's, not every job of a shared Prometheus).
    Fails on the old dashboard: only the datasource variable."""
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert list(variables) == ["datasource", "namespace", "job"]
    for name in ("namespace", "job"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"] == DS and v["includeAll"] and v["multi"], name
        assert "label_values(up{" in v["query"]["query"] and v["query"]["query"].endswith(f", {name})")
    assert variables["namespace"]["allValue"] == ".*"
    farm_jobs = variables["job"]["allValue"]
    assert all(re.fullmatch(farm_jobs, n) for names in JOBS.values() for n in names)
    assert not any(re.fullmatch(farm_jobs, n) for n in ("kube-state-metrics", "nvidia-dcgm-exporter", "raylet"))
    assert f'job=~"{farm_jobs}"' in variables["job"]["query"]["query"]


def scoped(selector) -> bool:
    ns, job = matcher(selector, "namespace"), matcher(selector, "job")
    re_ = promql_parser.MatchOp.Re
    return bool(ns and job and (ns.op, ns.value, job.op, job.value) == (re_, "$namespace", re_, "$job"))


@pytest.mark.parametrize("where, expr", {w: e for w, e in queries().items() if w.startswith("panel ")}.items())
def test_every_panel_query_filters_by_namespace_and_job(where, expr):
    """Every selector of the farm's, Ray's or `up` series has namespace=~"$namespace" and job=~"$job"; an
    exporter's series (kube-state-metrics, DCGM), whose job is the exporter's, is joined with such a selector.
    Fails on the old dashboard: no query filtered."""
    found = selectors(expr)
    assert any(scoped(s) for s in found)
    for s in found:
        if s.name.startswith((FARM_PREFIX, "ray_")) or s.name == "up":
            assert scoped(s), (s.name, [(m.name, m.value) for m in s.matchers.matchers])
