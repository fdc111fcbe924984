"""The metric names the Grafana dashboard and the Prometheus alert rules query, found by parsing their PromQL
(promql-parser, the Python bindings of the Rust parser), their types (the farm's from its own registries, Ray's
from the installed Ray's source), and the check that a scrape exports them. Shared by
tests/deploy/test_monitoring.py (static), tests/service/test_monitoring_metrics.py (the service's /metrics) and
tests/e2e/test_trainer_metrics.py (a real `farm train`'s)."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys
from pathlib import Path

import promql_parser
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "helm" / "rollout-farm" / "files"
DASHBOARD, ALERTS = FILES / "dashboard.json", FILES / "alerts.yaml"
FARM_PREFIX = "farm_"  # the farm's names; others are Ray's, Prometheus' (up), kube-state-metrics' and DCGM's
TRAINER_PREFIX = "farm_trainer_"  # served by the trainer (trainer.metrics_port); every other farm_ name by the service
# Each scrape target's job: as compose's Prometheus names it (deploy/prometheus/prometheus.yml), and as the chart's
# monitors set it (their `job` relabeling).
JOBS = {
    "service": ("service", "rollout-farm-service"),
    "ray": ("ray", "rollout-farm-ray"),
    "trainer": ("trainer", "rollout-farm-trainer"),
}


def installed_package(name: str) -> Path:
    """The folder of an installed package, wherever the running interpreter finds it (any virtual environment, any
    Python version), without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{name} is not installed in {sys.prefix}")
    return Path(next(iter(spec.submodule_search_locations)))


RAY = installed_package("ray")
# Ray's metrics the dashboard and the rules query (Ray 2.60, exported on its metrics port with the ray_ prefix): the
# type, the file of the installed ray package that defines it, and the name as written there. Counters are queried
# by their _total series: Ray also exports each counter without _total as a deprecated gauge. Metrics defined in
# Ray's C++ core (ray_object_store_memory) are found in Ray's own Grafana panels instead, where a gauge is queried
# without rate().
RAY_METRICS = {
    "ray_serve_deployment_replica_healthy": (
        "gauge",
        "serve/_private/deployment_state.py",
        "serve_deployment_replica_healthy",
    ),
    "ray_serve_deployment_status": ("gauge", "serve/_private/deployment_state.py", "serve_deployment_status"),
    "ray_serve_deployment_queued_queries": ("gauge", "serve/_private/router.py", "serve_deployment_queued_queries"),
    "ray_serve_deployment_processing_latency_ms_bucket": (
        "histogram",
        "serve/_private/replica.py",
        "serve_deployment_processing_latency_ms",
    ),
    "ray_serve_num_http_requests_total": (
        "counter",
        "serve/_private/request_ingress_metrics.py",
        "serve_num_{protocol_name}_requests",
    ),
    "ray_serve_num_http_error_requests_total": (
        "counter",
        "serve/_private/request_ingress_metrics.py",
        "serve_num_{protocol_name}_error_requests",
    ),
    "ray_node_cpu_utilization": ("gauge", "dashboard/modules/reporter/reporter_agent.py", "node_cpu_utilization"),
    "ray_node_mem_used": ("gauge", "dashboard/modules/reporter/reporter_agent.py", "node_mem_used"),
    "ray_node_mem_total": ("gauge", "dashboard/modules/reporter/reporter_agent.py", "node_mem_total"),
    "ray_node_gpus_utilization": ("gauge", "dashboard/modules/reporter/reporter_agent.py", "node_gpus_utilization"),
    "ray_node_gram_used": ("gauge", "dashboard/modules/reporter/reporter_agent.py", "node_gram_used"),
    "ray_object_store_memory": (
        "gauge",
        "dashboard/modules/metrics/dashboards/default_dashboard_panels.py",
        "sum(ray_object_store_memory{{",
    ),
}
# Neither the farm's nor Ray's: Prometheus' own, kube-state-metrics' (v2) and NVIDIA dcgm-exporter's.
OTHER_METRICS = {
    "up": "gauge",
    "kube_pod_container_status_restarts_total": "counter",
    "kube_deployment_status_replicas_available": "gauge",
    "kube_pod_info": "gauge",
    "DCGM_FI_DEV_GPU_UTIL": "gauge",
    "DCGM_FI_DEV_FB_USED": "gauge",
}
RANGE_OVER_COUNTERS = {"rate", "irate", "increase", "resets"}  # a reset is a drop; on a gauge, every drop is one
RANGE_OVER_GAUGES = {"deriv", "delta", "idelta", "predict_linear"}
# Grafana's interval variables, as Grafana would substitute them before Prometheus parses the query
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def alert_rules(rules: dict | None = None) -> list[dict]:
    return [r for g in (rules or yaml.safe_load(ALERTS.read_text()))["groups"] for r in g["rules"]]


def panels(dash: dict) -> list[dict]:
    """Every panel but the rows, including those inside collapsed rows."""
    out = []
    for p in dash["panels"]:
        out += p.get("panels", []) if p["type"] == "row" else [p]
    return out


def promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def queries(dash: dict | None = None, rules: dict | None = None) -> dict[str, str]:
    """Where -> PromQL: 'panel <title> <refId>' for each dashboard target, 'alert <name>' for each rule."""
    out = {}
    for p in panels(dash or dashboard()):
        for t in p.get("targets", []):
            out[f"panel {p['title']} {t['refId']}"] = promql(t["expr"])
    for r in alert_rules(rules):
        out[f"alert {r['alert']}"] = r["expr"]
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: its vector selectors' names (or __name__="..." matchers); not its
    functions, keywords, label names or values, or `by (...)` lists. A syntax error raises ValueError."""
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            names.update(
                [node.name]
                if node.name
                else [
                    m.value
                    for m in node.matchers.matchers
                    if m.name == "__name__" and m.op == promql_parser.MatchOp.Equal
                ]
            )

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def queried(trainer: bool, dash: dict | None = None, rules: dict | None = None) -> dict[str, set[str]]:
    """Metric name -> where it is queried, for the trainer's names (trainer=True) or the service's: farm_ names only
    (Ray's, `up` and the exporters' are not the farm's to export)."""
    out: dict[str, set[str]] = {}
    for where, expr in queries(dash, rules).items():
        for name in metric_names(expr):
            if name.startswith(FARM_PREFIX) and name.startswith(TRAINER_PREFIX) == trainer:
                out.setdefault(name, set()).add(where)
    return out


def selectors(expr: str) -> list:
    """Every vector selector of an expression (those inside range selectors included)."""
    found = []
    promql_parser.walk(
        promql_parser.parse(expr), lambda n: found.append(n) if isinstance(n, promql_parser.VectorSelector) else None
    )
    return found


def matcher(selector, label: str):
    """The selector's matcher on `label`, or None."""
    return next((m for m in selector.matchers.matchers if m.name == label), None)


def range_calls(expr: str) -> list[tuple[str, str]]:
    """(function, metric name) for each function applied to a range selector, e.g. ("rate", "x_total")."""
    found = []

    def visit(node):
        if isinstance(node, promql_parser.Call):
            for arg in node.args:
                if isinstance(arg, promql_parser.MatrixSelector):
                    found.append((node.func.name, arg.vector_selector.name))
                elif isinstance(arg, promql_parser.SubqueryExpr):
                    found.append((node.func.name, next(iter(metric_names(arg.expr.prettify())), "")))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def sample_types(text: str) -> dict[str, str]:
    """Sample name -> 'counter' (a counter's _total, a histogram's _bucket/_sum/_count) or 'gauge', for every family
    a Prometheus text declares, samples or none."""
    out = {}
    for f in text_string_to_metric_families(text):
        if f.type == "counter":
            out[f.name + "_total"] = "counter"
        elif f.type in ("histogram", "summary"):
            out.update({f.name + s: "counter" for s in ("_bucket", "_sum", "_count")})
        else:
            out[f.name] = f.type
    return out


@functools.cache
def farm_metric_types() -> dict[str, str]:
    """The farm's sample names and types, from the code: the service's registry
    (rollout_farm/services/observability/metrics.py, the queue's gauges) and the per-scrape families of its
    exposition(), and the trainer's (step gauges, guard actions)."""
    from prometheus_client import REGISTRY, generate_latest

    import rollout_farm.services.observability.metrics
    import rollout_farm.services.queue.gauges  # noqa: F401  (registers the queue's collector)
    import rollout_farm.trainer.guards.checks  # noqa: F401
    import rollout_farm.trainer.outputs.step_metrics  # noqa: F401

    text = (
        generate_latest(REGISTRY).decode()
        + rollout_farm.services.observability.metrics.exposition([], {}, "scrape").decode()
    )
    return {n: t for n, t in sample_types(text).items() if n.startswith(FARM_PREFIX)}


def ray_metric_types() -> dict[str, str]:
    """Ray's names as 'counter' (counters' _total, histograms' _bucket) or 'gauge'."""
    return {n: "gauge" if kind == "gauge" else "counter" for n, (kind, _, _) in RAY_METRICS.items()}


def metric_types() -> dict[str, str]:
    """Every queried name the checks know: the farm's, Ray's and the others'."""
    return farm_metric_types() | ray_metric_types() | OTHER_METRICS


def ray_definition_errors(metrics: dict = RAY_METRICS, ray: Path = RAY) -> dict[str, str]:
    """Name -> what is wrong, for each entry of `metrics` the installed Ray does not define so: the name as written
    in its file, made by a constructor of its type (Gauge, Counter, Histogram) just before it."""
    errors = {}
    constructor = {"gauge": "Gauge", "counter": "Counter", "histogram": "Histogram"}
    for name, (kind, file, written) in metrics.items():
        source = (ray / file).read_text() if (ray / file).is_file() else ""
        if "dashboards/" in file:  # Ray's own panels (a C++ metric)
            if written not in source:
                errors[name] = f"not in {file}"
            continue
        at = [m.start() for m in re.finditer(re.escape(f'"{written}"'), source)]
        made = [re.search(r"(\w+)\(\s*(?:name=)?f?$", source[max(0, i - 60) : i]) for i in at]
        kinds = {m.group(1) for m in made if m}
        if constructor[kind] not in kinds:
            errors[name] = f"{file} makes {written!r} with {sorted(kinds) or 'nothing'}, not {constructor[kind]}"
    return errors


def exported(text: str) -> dict[str, str]:
    """Sample name -> its family's type, for every sample in a Prometheus text (a family without samples, e.g. a
    labelled counter never touched, exports nothing a query could select)."""
    return {s.name: f.type for f in text_string_to_metric_families(text) for s in f.samples}


def missing(names, text: str) -> set[str]:
    """The names a scrape does not export as samples; a `_bucket` name must be a histogram family's."""
    have = exported(text)
    return {n for n in names if n not in have or (n.endswith("_bucket") and have[n] != "histogram")}
