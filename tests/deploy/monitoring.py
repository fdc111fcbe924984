"""The metric names the Grafana dashboard and the Prometheus alert rules query, found by parsing their PromQL
(promql-parser, the Python bindings of the Rust parser), and the check that a scrape exports them. Shared by
tests/deploy/test_monitoring.py (static), tests/service/test_monitoring_metrics.py (the service's /metrics) and
tests/e2e/test_trainer_metrics.py (a real `farm train`'s)."""

from __future__ import annotations

import json
from pathlib import Path

import promql_parser
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "helm" / "rollout-farm" / "files"
DASHBOARD, ALERTS = FILES / "dashboard.json", FILES / "alerts.yaml"
TRAINER_PREFIX = "farm_trainer_"  # served by the trainer (trainer.metrics_port); every other name by the service
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
    """Metric name -> where it is queried, for the trainer's names (trainer=True) or the service's."""
    out: dict[str, set[str]] = {}
    for where, expr in queries(dash, rules).items():
        for name in metric_names(expr):
            if name.startswith(TRAINER_PREFIX) == trainer:
                out.setdefault(name, set()).add(where)
    return out


def exported(text: str) -> dict[str, str]:
    """Sample name -> its family's type, for every sample in a Prometheus text (a family without samples, e.g. a
    labelled counter never touched, exports nothing a query could select)."""
    return {s.name: f.type for f in text_string_to_metric_families(text) for s in f.samples}


def missing(names, text: str) -> set[str]:
    """The names a scrape does not export as samples; a `_bucket` name must be a histogram family's."""
    have = exported(text)
    return {n for n in names if n not in have or (n.endswith("_bucket") and have[n] != "histogram")}
