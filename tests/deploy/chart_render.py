"""Render, lint and validate helm/rollout-farm offline (helm-python-sdk, kubernetes-validate, check-jsonschema)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
# ROLLOUT_FARM_TEST_CHART: another copy of the chart (e.g. an older commit's, to see a new test fail on it).
CHART = Path(os.environ.get("ROLLOUT_FARM_TEST_CHART") or ROOT / "helm" / "rollout-farm")
SCHEMAS = Path(__file__).parent / "schemas"
NAME, NAMESPACE = "farm", "ml"
FULLNAME = "farm-rollout-farm"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
# Custom resources: the vendored JSON Schema of each kind (tests/deploy/schemas/README.md).
CRD_SCHEMAS = {
    "RayService": SCHEMAS / "rayservice-v1.json",
    "ServiceMonitor": SCHEMAS / "servicemonitor-v1.json",
    "PodMonitor": SCHEMAS / "podmonitor-v1.json",
    "PrometheusRule": SCHEMAS / "prometheusrule-v1.json",
}
BASE = {"token": {"value": "test-token-123"}, "redis": {"url": "redis://redis.db:6379/0"}}


def merged(base: dict, override: dict) -> dict:
    """`override` deep-merged into a copy of `base` (as helm merges -f files)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def render(values: dict, chart: Path = CHART, name: str = NAME) -> list[dict]:
    """The manifests of the chart with `values`, parsed, in template order (NOTES.txt left out)."""
    with helm.Chart.load(chart) as loaded:
        rendered = loaded.render(values, name=name, namespace=NAMESPACE)
    return [
        doc
        for path, text in sorted(rendered.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def notes(values: dict) -> str:
    with helm.Chart.load(CHART) as loaded:
        return loaded.render(values, name=NAME, namespace=NAMESPACE)["rollout-farm/templates/NOTES.txt"]


def render_error(values: dict, chart: Path = CHART, name: str = NAME) -> str:
    """The message a render with `values` fails with (helm's schema check or a template's fail)."""
    try:
        render(values, chart, name)
    except (helm.HelmRenderError, helm.HelmValuesError) as e:
        return str(e)
    raise AssertionError(f"rendered without an error: {values}")


def lint_findings(values: dict) -> list[str]:
    """`helm lint --strict` warnings and errors (info, e.g. "icon is recommended", is not a finding)."""
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    return [m["error"] for m in report["messages"] if m["severity"] >= 2] + list(report.get("errors") or [])


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def pod_specs(rayservice: dict) -> dict[str, dict]:
    """The head's and the (one) worker group's Pod specs."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]["template"]["spec"]} | {
        "worker": g["template"]["spec"] for g in cluster["workerGroupSpecs"]
    }


def ray_containers(docs: list[dict]) -> dict[str, dict]:
    """The head's and the worker group's Ray containers."""
    return {role: spec["containers"][0] for role, spec in pod_specs(one(docs, "RayService")).items()}


def all_containers(doc: dict) -> list[dict]:
    """Every container (and init container) of a RayService, workload or Pod."""
    if doc["kind"] == "RayService":
        return [s["containers"][0] for s in pod_specs(doc).values()]
    spec = doc.get("spec", {}).get("template", {}).get("spec", doc.get("spec", {}))
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def env(container: dict) -> dict[str, str | dict]:
    """A container's env as {name: value or valueFrom}."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def serve_config(rayservice: dict) -> dict:
    """The RayService's serveConfigV2, parsed."""
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def serve_app(rayservice: dict) -> dict:
    """The (one) Serve application of serveConfigV2."""
    (app,) = serve_config(rayservice)["applications"]
    return app


def serve_env(rayservice: dict) -> dict[str, str]:
    """The Serve application's runtime_env env_vars: the service's non-secret FARM_* settings."""
    return serve_app(rayservice)["runtime_env"]["env_vars"]


def serve_deployments(rayservice: dict) -> dict[str, dict]:
    """serveConfigV2's deployment options by deployment name, without the name."""
    return {d["name"]: {k: v for k, v in d.items() if k != "name"} for d in serve_app(rayservice)["deployments"]}


def validate_core(doc: dict) -> None:
    """kubernetes-validate, strict (unknown fields fail), against every version of K8S_VERSIONS."""
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def pod_templates(rayservice: dict) -> list[dict]:
    """The RayService's Pod templates as PodTemplate objects, so kubernetes-validate checks them like Pods."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": g["template"]}
        for g in groups
    ]


def check_jsonschema(schema: Path, docs: list[dict]) -> subprocess.CompletedProcess:
    """check-jsonschema (as CI would run it) on the docs, each written to its own file."""
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, doc in enumerate(docs):
            files.append(Path(tmp) / f"{i}-{doc['kind']}.json")
            files[-1].write_text(json.dumps(doc))
        cmd = [sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema), *map(str, files)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def documented_values(text: str) -> tuple[dict[str, str], list[str]]:
    """helm-docs style: ({dotted key: its `# --` description}, [keys with neither a description nor documented
    children]). A described key covers its children; list items are not keys."""
    docs, missing, stack, comment = {}, [], [], []  # stack: (indent, key, described)
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment = [*comment, stripped] if stripped.startswith("# --") or comment else []
            continue
        if not stripped or stripped.startswith("- ") or ":" not in stripped:
            comment = [] if not stripped else comment
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = stripped.split(":", 1)[0].strip()
        if any(described for *_, described in stack):
            comment = []
            continue
        path = ".".join([*(k for _, k, _ in stack), key])
        if comment:
            docs[path] = " ".join(c.removeprefix("# --").removeprefix("#").strip() for c in comment)
        elif stripped.split(":", 1)[1].strip():  # a leaf without a description
            missing.append(path)
        stack.append((indent, key, bool(comment)))
        comment = []
    return docs, missing


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector (matchLabels and matchExpressions) against a label set; {} selects everything."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if not {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]:
            return False
    return True


def admits(policy: dict, port: int, labels: dict[str, str], namespace: str = NAMESPACE) -> bool:
    """Whether a NetworkPolicy's ingress rules let a Pod with `labels` in `namespace` reach `port` (TCP) of the Pods it
    selects, by the API's rules: a peer with only a podSelector means the policy's own namespace, one with a
    namespaceSelector the namespaces it selects (by their kubernetes.io/metadata.name label here); no ports: all."""
    namespace_labels = {"kubernetes.io/metadata.name": namespace}
    for rule in policy["spec"].get("ingress") or []:
        ports = rule.get("ports") or [{}]
        if not any(
            p.get("protocol", "TCP") == "TCP" and ("port" not in p or p["port"] <= port <= p.get("endPort", p["port"]))
            for p in ports
        ):
            continue
        if "from" not in rule:  # every source
            return True
        for peer in rule["from"]:
            if "namespaceSelector" in peer:
                in_namespace = selects(peer["namespaceSelector"], namespace_labels)
            else:
                in_namespace = namespace == policy["metadata"].get("namespace", NAMESPACE)
            if in_namespace and selects(peer.get("podSelector") or {}, labels):
                return True
    return False
