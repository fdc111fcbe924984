"""Negative controls of kuberay_validation.py, the port of the pinned KubeRay operator's semantic checks: the chart's
template without autoscaler v2 (what it rendered before issue 27) and hand-made RayServices that break other ported
rules each fail with KubeRay's message. test_chart.py runs the same checks on every value set it renders."""

from __future__ import annotations

import copy
import re
import shutil

import pytest

from tests.deploy.chart_render import BASE, CHART, merged, one, render
from tests.deploy.kuberay_validation import KUBERAY_TAG, rayservice_error

AUTOSCALING = merged(BASE, {"autoscaling": {"enabled": True}})
V2_LINE = "      version: v2\n"


def test_the_chart_pins_the_validated_operator():
    chart_yaml = (CHART / "Chart.yaml").read_text()
    assert re.search(rf'^  rollout-farm/kuberay-operator: "{KUBERAY_TAG[1:]}"$', chart_yaml, re.M)


def test_template_without_autoscaler_v2_is_refused(tmp_path):
    """The template as it was: worker idleTimeoutSeconds without autoscalerOptions.version v2 (KubeRay >= 1.6)."""
    chart = shutil.copytree(CHART, tmp_path / "rollout-farm")
    template = chart / "templates" / "rayservice.yaml"
    assert template.read_text().count(V2_LINE) == 1
    template.write_text(template.read_text().replace(V2_LINE, ""))
    doc = one(render(AUTOSCALING, chart=chart), "RayService")
    assert rayservice_error(doc) == (
        "The RayService spec is invalid: worker group engine: idleTimeoutSeconds is set, but autoscaler v2 is not "
        "enabled. Please set .spec.autoscalerOptions.version to 'v2' (or set RAY_enable_autoscaler_v2 environment "
        "variable to 'true' in the head pod if using KubeRay < 1.4.0)"
    )
    assert rayservice_error(one(render(AUTOSCALING), "RayService")) is None


def test_documented_annotation_is_accepted():
    values = merged(AUTOSCALING, {"serve": {"annotations": {"ray.io/initializing-timeout": "30m"}}})
    assert rayservice_error(one(render(values), "RayService")) is None


def cluster(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig"]


def head(doc: dict) -> dict:
    return cluster(doc)["headGroupSpec"]["template"]["spec"]


def group(doc: dict) -> dict:
    return cluster(doc)["workerGroupSpecs"][0]


def add_head_env(doc: dict, name: str, value: str) -> None:
    head(doc)["containers"][0]["env"].append({"name": name, "value": value})


def annotate(doc: dict, key: str, value: str) -> None:
    doc["metadata"].setdefault("annotations", {})[key] = value


# (values to render: "default" or "autoscaling", the change, a part of KubeRay's message)
BROKEN = {
    "name over 47": ("default", lambda d: d["metadata"].update(name="r" * 48), "no more than 47 characters"),
    "name not DNS-1035": (
        "default",
        lambda d: d["metadata"].update(name="Farm"),
        "RayService name should be a valid DNS1035 label: [a DNS-1035 label must consist of lower case alphanumeric "
        "characters or '-', start with an alphabetic character, and end with an alphanumeric character (e.g. "
        "'my-name',  or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')]",
    ),
    "zero initializing timeout": (
        "default",
        lambda d: annotate(d, "ray.io/initializing-timeout", "0s"),
        "annotation ray.io/initializing-timeout must be a positive duration, got: 0s",
    ),
    "bad initializing timeout": (
        "default",
        lambda d: annotate(d, "ray.io/initializing-timeout", "soon"),
        "annotation ray.io/initializing-timeout has invalid format: soon",
    ),
    "minReplicas over maxReplicas": (
        "autoscaling",
        lambda d: group(d).update(minReplicas=5),
        "worker group engine has minReplicas 5 greater than maxReplicas 4",
    ),
    "negative idle timeout": (
        "autoscaling",
        lambda d: group(d).update(idleTimeoutSeconds=-1),
        "worker group engine: idleTimeoutSeconds must be non-negative, got -1",
    ),
    "v2 and its env var": (
        "autoscaling",
        lambda d: add_head_env(d, "RAY_enable_autoscaler_v2", "1"),
        "both .spec.autoscalerOptions.version and head Pod env var RAY_enable_autoscaler_v2 are set",
    ),
    "v2 env without autoscaling": (
        "default",
        lambda d: add_head_env(d, "RAY_enable_autoscaler_v2", "true"),
        "environment variable RAY_enable_autoscaler_v2 cannot be set to 'true' when enableInTreeAutoscaling is false",
    ),
    "v2 with a restarting head": (
        "autoscaling",
        lambda d: head(d).update(restartPolicy="Always"),
        "restartPolicy for head Pod should be Never or unset when using autoscaler V2",
    ),
    "priority below Ray 2.56": (
        "autoscaling",
        lambda d: (group(d).update(priority=1), cluster(d).update(rayVersion="2.55.0")),
        "worker group engine: priority is set, but minimum Ray version is 2.56.0, got 2.55.0",
    ),
    "num-cpus twice": (
        "default",
        lambda d: group(d).update(rayStartParams={"num-cpus": "4"}, resources={"CPU": "4"}),
        "resource fields should not be set in both rayStartParams and Resources for engine group",
    ),
    "bad Ray label": (
        "default",
        lambda d: group(d).update(labels={"tier/": "gpu"}),
        "invalid label key for engine group: 'tier/', error: name part must be non-empty",
    ),
    "Redis password env with GCS FT": (
        "autoscaling",
        lambda d: (
            cluster(d).update(gcsFaultToleranceOptions={"redisAddress": "r:6379"}),
            add_head_env(d, "REDIS_PASSWORD", "x"),
        ),
        "cannot set `REDIS_PASSWORD` env var in head Pod when GcsFaultToleranceOptions is enabled - use "
        "GcsFaultToleranceOptions.RedisPassword instead",
    ),
    "Redis address without GCS FT": (
        "default",
        lambda d: add_head_env(d, "RAY_REDIS_ADDRESS", "r:6379"),
        "RAY_REDIS_ADDRESS is set which implicitly enables GCS fault tolerance",
    ),
    "FT annotation and options": (
        "default",
        lambda d: (annotate(d, "ray.io/ft-enabled", "true"), cluster(d).update(gcsFaultToleranceOptions={})),
        "ray.io/ft-enabled annotation and GcsFaultToleranceOptions are both set",
    ),
    "unknown upgrade type": (
        "default",
        lambda d: d["spec"]["upgradeStrategy"].update(type="Rolling"),
        "Spec.UpgradeStrategy.Type value Rolling is invalid, valid options are NewClusterWithIncrementalUpgrade",
    ),
    "incremental upgrade without options": (
        "autoscaling",
        lambda d: d["spec"]["upgradeStrategy"].update(type="NewClusterWithIncrementalUpgrade"),
        "The RayService spec is invalid: ClusterUpgradeOptions are required for NewClusterWithIncrementalUpgrade",
    ),
    "head service name": (
        "default",
        lambda d: cluster(d)["headGroupSpec"].update(headService={"metadata": {"name": "head"}}),
        "spec.rayClusterConfig.headGroupSpec.headService.metadata.name should not be set",
    ),
    "network policy, gate off": (
        "default",
        lambda d: cluster(d).update(networkPolicy={}),
        "spec.networkPolicy requires the RayClusterNetworkPolicy feature gate to be enabled",
    ),
    "token auth below Ray 2.52": (
        "default",
        lambda d: cluster(d).update(authOptions={"mode": "token"}, rayVersion="2.51.0"),
        "authOptions.mode is 'token' but minimum Ray version is 2.52.0, got 2.51.0",
    ),
    "cluster upgrade strategy": (
        "default",
        lambda d: cluster(d).update(upgradeStrategy={"type": "Recreate"}),
        "upgradeStrategy cannot be set when RayCluster is created by RayService",
    ),
    "managedBy": (
        "default",
        lambda d: d["spec"].update(managedBy="me"),
        "the managedBy field value must be either 'ray.io/kuberay-operator' or 'kueue.x-k8s.io/multikueue'",
    ),
}
RENDERED = {"default": one(render(BASE), "RayService"), "autoscaling": one(render(AUTOSCALING), "RayService")}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_rayservice_is_refused(case):
    values, change, message = BROKEN[case]
    doc = copy.deepcopy(RENDERED[values])
    assert rayservice_error(doc) is None
    change(doc)
    error = rayservice_error(doc)
    assert error is not None and message in error, error
