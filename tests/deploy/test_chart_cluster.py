"""The chart on a real, shared GPU cluster (issue 27): SGLang's GPU share, weights that survive an upgrade, the
images per Pod, NetworkPolicies and the Redis password, head sizing, the ingress pinned to the head, settings applied
in place, storage, the trainer Job, disruption budgets, and GPU values that add up. Each test's docstring names what
the templates before issue 27 did that it catches (run with ROLLOUT_FARM_TEST_CHART=<an old copy of the chart>)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.serving.app import engine_scaling
from tests.deploy.chart_render import (
    BASE,
    FULLNAME,
    ROOT,
    admits,
    env,
    merged,
    notes,
    one,
    pod_specs,
    ray_containers,
    render,
    render_error,
    serve_config,
    serve_deployments,
    serve_env,
)
from tests.deploy.kuberay_validation import rayservice_error

GPU = {"gpu": {"enabled": True, "perWorker": 2, "perReplica": 1}, "dtype": "bfloat16"}
FUSED = {"serve": {"front": "fused"}}  # no ingress deployment: the engine replicas are their own (the default)
SPLIT = {"serve": {"front": "split"}}  # an ingress deployment of ingressReplicas
SGLANG = merged(GPU, {"engine": "sglang", "model": "/data/models/m"})
IN_CHART_REDIS = {"redis": {"url": "", "inChart": {"enabled": True}}, "gcsFaultTolerance": {"enabled": True}}
# The GPU values that must add up: 2 worker Pods at most, 4 GPUs each, one GPU per SGLang engine: 8 engines at most.
GPU_FLEET = {
    "engine": "sglang",
    "model": "/data/models/m",
    "gpu": {"enabled": True, "perWorker": 4, "perReplica": 1},
    "replicas": 2,
    "autoscaling": {"enabled": True, "maxReplicas": 8},
    "worker": {"minReplicas": 1, "maxReplicas": 2},
    "settings": {"max_weights_bytes": 16 << 30},
    "head": {"resources": {"requests": {"cpu": "2", "memory": "24Gi"}, "limits": {"memory": "24Gi"}}},
}


def rendered(override: dict) -> list[dict]:
    return render(merged(BASE, override))


def rayservice(override: dict) -> dict:
    return one(rendered(override), "RayService")


def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


# -- Blocker 2: SGLang's share of a GPU --------------------------------------------------------------------------


def test_sglang_tensor_parallelism_follows_the_gpu_share():
    """Old: a replica on 2 GPUs got no FARM_SGLANG_TP_SIZE, so SGLang ran tp 1 and the second GPU sat idle."""
    farm = serve_env(rayservice(merged(SGLANG, {"gpu": {"perReplica": 2}})))
    assert (farm["FARM_ENGINE_NUM_GPUS"], farm["FARM_SGLANG_TP_SIZE"]) == ("2", "2")
    assert serve_env(rayservice(SGLANG))["FARM_SGLANG_TP_SIZE"] == "1"
    shared = serve_env(
        rayservice(merged(SGLANG, {"gpu": {"perReplica": 0.5}, "settings": {"sglang_mem_fraction_static": 0.4}}))
    )
    assert shared["FARM_SGLANG_MEM_FRACTION_STATIC"] == "0.4" and "FARM_SGLANG_TP_SIZE" not in shared
    assert "FARM_SGLANG_TP_SIZE" not in serve_env(rayservice(GPU)), "the torch engine has no tensor parallelism"


@pytest.mark.parametrize(
    "gpu, settings, message",
    [
        ({"perReplica": 0.5}, {}, "gpu.perReplica=0.5 with engine sglang puts several engines on one GPU"),
        ({"perReplica": 0.5}, {"sglang_mem_fraction_static": 0.6}, "sglang_mem_fraction_static=0.6 is not below"),
        # equal to the share: SGLang's static pool alone fills it, and the engine's activations and CUDA context need
        # memory outside the pool (issue 40)
        ({"perReplica": 0.5}, {"sglang_mem_fraction_static": 0.5}, "sglang_mem_fraction_static=0.5 is not below"),
        ({"perReplica": 0.25}, {"sglang_mem_fraction_static": 0.25}, "set it below the share, e.g. 0.21"),
        ({"perWorker": 2, "perReplica": 1.5}, {}, "gpu.perReplica=1.5 with engine sglang"),
    ],
)
def test_sglang_gpu_shares_that_cannot_work_are_refused(gpu, settings, message):
    """Old: two SGLang engines on one GPU rendered without a memory fraction (the second one ran out of memory), and
    1.5 GPUs per replica rendered too."""
    assert message in render_error(merged(BASE, merged(SGLANG, {"gpu": gpu, "settings": settings})))


@pytest.mark.parametrize("share, fraction", [(0.5, 0.45), (0.5, 0.49), (0.25, 0.2)])
def test_a_memory_fraction_below_the_gpu_share_is_accepted(share, fraction):
    """The control of the refusals above: a fraction with headroom below the share renders, and reaches SGLang."""
    values = merged(SGLANG, {"gpu": {"perReplica": share}, "settings": {"sglang_mem_fraction_static": fraction}})
    assert serve_env(rayservice(values))["FARM_SGLANG_MEM_FRACTION_STATIC"] == str(fraction)


# -- Blocker 3: weights survive an upgrade ------------------------------------------------------------------------


def test_uploads_are_kept_on_the_shared_volume():
    """Old: no FARM_UPLOADS_DIR, so an upload lived only in Ray's object store and a new cluster lost it."""
    farm = serve_env(rayservice({"storage": {"mountPath": "/shared/"}}))
    assert farm["FARM_WEIGHTS_DIR"] == "/shared/weights"
    assert farm["FARM_UPLOADS_DIR"] == "/shared/weights/uploads", "inside FARM_WEIGHTS_DIR, which path pushes may load"
    for spec in pod_specs(rayservice({"storage": {"mountPath": "/shared/"}})).values():
        assert spec["containers"][0]["volumeMounts"] == [{"name": "data", "mountPath": "/shared/"}]


# -- Blocker 4 and the GPU image: which image each Pod pulls -------------------------------------------------------


def test_each_pod_pulls_the_image_it_needs():
    """Old: with gpu.enabled the trainer (even without GPUs) and the helm test Pod pulled the -gpu image, and a trainer
    with GPUs had no image that held CUDA torch and the trainer."""
    docs = rendered(merged(GPU, {"trainer": {"enabled": True, "gpus": 0}}))
    assert one(docs, "Job")["spec"]["template"]["spec"]["containers"][0]["image"] == "rollout-farm:0.1.0"
    assert one(docs, "Pod")["spec"]["containers"][0]["image"] == "rollout-farm:0.1.0", "helm test needs no GPU"
    gpu_trainer = one(rendered(merged(GPU, {"trainer": {"enabled": True, "gpus": 1}})), "Job")
    assert gpu_trainer["spec"]["template"]["spec"]["containers"][0]["image"] == "rollout-farm:0.1.0-gpu"
    cpu_cluster = one(rendered({"trainer": {"enabled": True, "gpus": 1}}), "Job")
    assert cpu_cluster["spec"]["template"]["spec"]["containers"][0]["image"] == "rollout-farm:0.1.0-gpu"
    # The head joins the workers' Ray cluster (Ray refuses another Python): their image unless told they match.
    ray = ray_containers(docs)
    assert ray["head"]["image"] == ray["worker"]["image"] == "rollout-farm:0.1.0-gpu"
    assert ray_containers(rendered(merged(GPU, {"head": {"cpuImage": True}})))["head"]["image"] == "rollout-farm:0.1.0"
    assert {c["image"] for c in ray_containers(rendered({})).values()} == {"rollout-farm:0.1.0"}


# -- Blocker 5: the network, the Redis password, the generation token ---------------------------------------------


def test_network_policies_are_on_by_default():
    """Old: no NetworkPolicy: the dashboard (job submission), GCS, client port and Redis were open to the cluster."""
    docs = rendered(IN_CHART_REDIS)
    ray, redis = (
        next(d for d in kinds(docs, "NetworkPolicy") if d["metadata"]["name"].endswith(s)) for s in ("-ray", "-redis")
    )
    assert ray["spec"]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/instance": "farm",
        "app.kubernetes.io/part-of": "rollout-farm",
    }
    release = {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "farm"}}}
    rules = ray["spec"]["ingress"]
    ports = {tuple(p["port"] for p in r.get("ports", [])): r["from"] for r in rules}
    operator = ports[(8265, 8000)]
    assert operator == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
        }
    ]
    assert ports[(8000,)] == [{"podSelector": {}}], "the API to the namespace by default"
    assert redis["spec"]["ingress"] == [{"from": [release], "ports": [{"port": 6379, "protocol": "TCP"}]}]
    # every Ray Pod is selected by the policy
    labels = [
        g["template"]["metadata"]["labels"]
        for g in [one(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]]
        + one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    ]
    assert all(ray["spec"]["podSelector"]["matchLabels"].items() <= lab.items() for lab in labels)
    wider = rendered({"networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"x": "monitoring"}}}]}})
    assert any(
        r.get("ports") == [{"port": 8080, "protocol": "TCP"}, {"port": 8000, "protocol": "TCP"}]
        for r in kinds(wider, "NetworkPolicy")[0]["spec"]["ingress"]
    )
    assert not kinds(rendered({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


RELEASE_POD = {"app.kubernetes.io/instance": "farm"}
RAY_WORKER = RELEASE_POD | {"app.kubernetes.io/part-of": "rollout-farm", "rollout-farm/component": "worker"}
RAY_HEAD = RAY_WORKER | {"rollout-farm/component": "head"}
TRAINER = RELEASE_POD | {"app.kubernetes.io/component": "trainer"}
OPERATOR = {"app.kubernetes.io/name": "kuberay-operator"}
# Where Ray takes code: the dashboard (job submission), the GCS and the client server (a driver)
CODE_PORTS = (8265, 52365, 6379, 10001)  # the dashboard, its agent's job API, the GCS, the client server


def ray_policy(docs: list[dict]) -> dict:
    return next(d for d in kinds(docs, "NetworkPolicy") if d["metadata"]["name"].endswith("-ray"))


def test_only_the_ray_pods_and_the_operator_reach_the_dashboard():
    """Old (issue 40): any Pod with the release's instance label (the trainer, the helm test Pod, or any Pod a tenant
    labels so) reached every Ray port, the dashboard's job submission (code execution) included."""
    policy = ray_policy(rendered({}))
    for labels in (RAY_HEAD, RAY_WORKER):  # Ray's own traffic: every port
        assert all(admits(policy, port, labels) for port in (*CODE_PORTS, 8000, 8080, 30000))
    assert admits(policy, 8265, OPERATOR, "kuberay-system") and admits(policy, 8000, OPERATOR, "kuberay-system")
    assert not admits(policy, 8265, OPERATOR, "ml"), "the operator's labels in another namespace are not the operator"
    assert not admits(policy, 6379, OPERATOR, "kuberay-system"), "the operator needs only the dashboard and serve port"
    for labels in (TRAINER, RELEASE_POD, {}):
        assert not any(admits(policy, port, labels) for port in CODE_PORTS), labels
        assert admits(policy, 8000, labels), "the API: serveFrom's default is the namespace"
    # the release's other Pods keep the rest (an NCCL weight push from the trainer opens connections to the engines)
    assert all(
        admits(policy, port, TRAINER)
        for port in (1, 6378, 6380, 8080, 8264, 8266, 10000, 10002, 29500, 52364, 52366, 65535)
    )
    assert not admits(policy, 29500, {}), "a Pod outside the release: the serve port only"
    moved = ray_policy(rendered({"networkPolicy": {"operator": {"namespace": "ray", "podLabels": {"app": "op"}}}}))
    assert admits(moved, 8265, OPERATOR | {"app": "op"}, "ray"), "an operator elsewhere (podLabels merge with Helm's)"
    assert not admits(moved, 8265, OPERATOR, "kuberay-system") and not admits(moved, 8265, OPERATOR, "ray")
    # every Ray Pod of the chart carries the labels the policy admits by
    cluster = one(rendered({}), "RayService")["spec"]["rayClusterConfig"]
    for group, expected in ((cluster["headGroupSpec"], RAY_HEAD), (cluster["workerGroupSpecs"][0], RAY_WORKER)):
        assert expected.items() <= group["template"]["metadata"]["labels"].items()


def test_the_policy_check_catches_an_open_dashboard():
    """Negative control of admits(): the policy as it was (every port to the release's Pods) lets the trainer reach
    the dashboard, and the test above would fail on it."""
    policy = ray_policy(rendered({}))
    old = {**policy, "spec": {**policy["spec"], "ingress": [{"from": [{"podSelector": {"matchLabels": RELEASE_POD}}]}]}}
    assert admits(old, 8265, TRAINER) and not admits(old, 8265, {})
    assert admits({**old, "spec": {**old["spec"], "ingress": [{}]}}, 8265, {}), "a rule without `from`: everyone"


def test_redis_password_reaches_the_service_the_gcs_and_the_server():
    """Old: the in-chart Redis had no password; FARM_REDIS_URL and the GCS connected without one."""
    docs = rendered(IN_CHART_REDIS)
    secret = next(d for d in kinds(docs, "Secret") if d["metadata"]["name"] == f"{FULLNAME}-redis")
    assert len(secret["data"]["password"]) >= 40, "32 generated characters, base64"
    ref = {"secretKeyRef": {"name": f"{FULLNAME}-redis", "key": "password"}}
    for container in ray_containers(docs).values():
        names = [e["name"] for e in container["env"]]
        assert env(container)["ROLLOUT_FARM_REDIS_PASSWORD"] == ref
        assert names.index("ROLLOUT_FARM_REDIS_PASSWORD") < names.index("FARM_REDIS_URL"), "$(VAR) needs VAR first"
        assert env(container)["FARM_REDIS_URL"] == f"redis://:$(ROLLOUT_FARM_REDIS_PASSWORD)@{FULLNAME}-redis:6379/0"
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["gcsFaultToleranceOptions"]["redisPassword"] == {"valueFrom": ref}
    redis = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert env(redis)["REDISCLI_AUTH"] == ref and redis["args"][-2:] == ["--requirepass", "$(REDISCLI_AUTH)"]
    assert "redis-cli ping" in " ".join(redis["readinessProbe"]["exec"]["command"]), "redis-cli reads REDISCLI_AUTH"
    assert rayservice_error(one(docs, "RayService")) is None, "no REDIS_PASSWORD env on the head, which KubeRay refuses"
    external = merged(BASE, {"redis": {"auth": {"existingSecret": "redis-pw"}}, "gcsFaultTolerance": {"enabled": True}})
    rs = one(render(external), "RayService")
    head = ray_containers(render(external))["head"]
    assert env(head)["FARM_REDIS_URL"] == "redis://:$(ROLLOUT_FARM_REDIS_PASSWORD)@redis.db:6379/0"
    password = rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisPassword"]
    assert password == {"valueFrom": {"secretKeyRef": {"name": "redis-pw", "key": "password"}}}
    assert "ROLLOUT_FARM_REDIS_PASSWORD" not in env(ray_containers(rendered({}))["head"]), "external Redis without auth"
    both = merged(BASE, {"redis": {"url": "redis://:pw@r:6379/0", "auth": {"existingSecret": "s"}}})
    assert "give the password only in the Secret" in render_error(both)


@pytest.mark.parametrize(
    "url, expected",
    [
        (
            "rediss://redis.db:6380/2?ssl_cert_reqs=required&socket_timeout=5",
            "rediss://:$(ROLLOUT_FARM_REDIS_PASSWORD)@redis.db:6380/2?ssl_cert_reqs=required&socket_timeout=5",
        ),
        ("redis://redis.db:6379/0", "redis://:$(ROLLOUT_FARM_REDIS_PASSWORD)@redis.db:6379/0"),  # no query: no "?"
    ],
)
def test_a_redis_url_keeps_its_query_string_with_a_password_secret(url, expected):
    """Old (issue 40): with redis.auth.existingSecret the URL was rebuilt from scheme, host and path, so redis-py's
    options in the query string (TLS verification, timeouts) were dropped."""
    docs = rendered({"redis": {"url": url, "auth": {"existingSecret": "redis-pw"}}})
    assert {env(c)["FARM_REDIS_URL"] for c in ray_containers(docs).values()} == {expected}
    without_secret = ray_containers(rendered({"redis": {"url": url}}))["head"]
    assert env(without_secret)["FARM_REDIS_URL"] == url, "without a Secret the URL is passed as given"


def test_generation_needs_the_token_by_default():
    """Old: FARM_REQUIRE_TOKEN_FOR_GENERATION was not set: anyone who reached the API could generate."""
    assert serve_env(rayservice({}))["FARM_REQUIRE_TOKEN_FOR_GENERATION"] == "true"
    assert (
        serve_env(rayservice({"token": {"requireForGeneration": False}}))["FARM_REQUIRE_TOKEN_FOR_GENERATION"]
        == "false"
    )


def test_kuberay_token_auth_is_on_by_default():
    """Old: no way to turn on KubeRay's authOptions (the value did not exist); then (issue 40) off by default, so the
    dashboard, GCS and client server took anyone the NetworkPolicy let through (or everyone, without a CNI that
    enforces it)."""
    default = rayservice({})
    assert default["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}, "KubeRay makes the token Secret"
    assert rayservice_error(default) is None
    rs = rayservice({"rayAuth": {"secretName": "ray-token"}})
    assert rs["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    assert rayservice_error(rs) is None
    assert "authOptions" not in rayservice({"rayAuth": {"enabled": False}})["spec"]["rayClusterConfig"]
    assert "get rayservice farm-rollout-farm -o jsonpath='{.status.activeServiceStatus.rayClusterName}'" in notes(
        merged(BASE, {})
    ), "NOTES say where the dashboard's token is"
    assert "get secret ray-token -o jsonpath='{.data.auth_token}'" in notes(
        merged(BASE, {"rayAuth": {"secretName": "ray-token"}})
    )


def test_token_auth_on_a_ray_without_it_is_refused():
    """Ray's token auth starts at 2.52: the chart says so instead of KubeRay refusing the cluster later (its message,
    from the ported validation.go, is the control that such a RayService is wrong)."""
    old_ray = {"rayVersion": "2.51.0"}
    assert "rayAuth.enabled: Ray's token authentication needs Ray 2.52.0 or later, and rayVersion is 2.51.0" in (
        render_error(merged(BASE, old_ray))
    )
    without = rayservice(merged(old_ray, {"rayAuth": {"enabled": False}}))  # the control: without auth it renders
    assert without["spec"]["rayClusterConfig"]["rayVersion"] == "2.51.0"
    with_auth = rayservice({})
    with_auth["spec"]["rayClusterConfig"]["rayVersion"] = "2.51.0"
    assert rayservice_error(with_auth) == (
        "The RayService spec is invalid: authOptions.mode is 'token' but minimum Ray version is 2.52.0, got 2.51.0"
    )
    assert rayservice(merged(old_ray, {"rayVersion": "2.52.0"}))["spec"]["rayClusterConfig"]["authOptions"]


# -- Head sizing and the ingress's place ---------------------------------------------------------------------------


def test_head_memory_exceeds_the_largest_upload():
    """Old: the head's 8Gi limit equalled the 8 GiB largest upload, and nothing checked it."""
    limit = ray_containers(rendered({}))["head"]["resources"]["limits"]["memory"]
    assert limit == "16Gi"
    error = render_error(merged(BASE, {"settings": {"max_weights_bytes": 14 << 30}}))
    assert "head.resources.limits.memory (16Gi) must exceed settings.max_weights_bytes (14.0 GiB" in error
    assert "set it above 18Gi" in error
    assert "set it above 12Gi" in render_error(merged(BASE, {"head": {"resources": {"limits": {"memory": "8Gi"}}}}))


def test_worker_defaults_follow_the_gpus():
    """Old: GPU workers kept the CPU workers' 4 CPUs and 16Gi whatever their GPUs."""
    worker = ray_containers(rendered(GPU))["worker"]["resources"]
    assert worker["limits"] == {"cpu": "16", "memory": "96Gi", "nvidia.com/gpu": 2}
    assert worker["requests"] == worker["limits"]
    assert ray_containers(rendered({}))["worker"]["resources"]["limits"] == {"cpu": "4", "memory": "16Gi"}
    given = {"requests": {"cpu": "6"}, "limits": {"cpu": "6", "memory": "40Gi"}}
    assert ray_containers(rendered(merged(GPU, {"worker": {"resources": given}})))["worker"]["resources"]["limits"] == {
        "cpu": "6",
        "memory": "40Gi",
        "nvidia.com/gpu": 2,
    }


def test_ingress_is_pinned_to_the_head():
    """Old: ingress replicas (and the weight store) asked for 0 CPUs and nothing else, so Serve could place them on
    GPU workers. rollout_farm/services/serving/app.py turns FARM_CONTROL_RESOURCE into their ray_actor_options
    (tests/unit/test_app_config.py). The split front's ingress; the fused front has none (the store is pinned)."""
    assert set(serve_deployments(rayservice(merged(GPU, FUSED)))) == {"engine"}
    rs = rayservice(merged(GPU, SPLIT))
    start = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert json.loads(start["resources"].strip("'")) == {"farm_head": 100}
    assert start["num-cpus"] == "0"
    assert serve_env(rs)["FARM_CONTROL_RESOURCE"] == "farm_head"  # each ingress replica and the store ask for one
    assert "ray_actor_options" not in serve_deployments(rs)["ingress"]  # the app's own options, from that setting
    custom = rayservice({"head": {"rayStartParams": {"resources": "'{\"disk\": 2}'"}}})
    start = custom["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert json.loads(start["resources"].strip("'")) == {"disk": 2, "farm_head": 100}
    assert all(
        "farm_head" not in json.dumps(g["rayStartParams"]) for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    )


# -- Settings in serveConfigV2 --------------------------------------------------------------------------------------

SECRET_ENV = {"FARM_API_TOKEN", "FARM_REDIS_URL"}


def test_settings_live_in_serve_config_not_in_pod_env():
    """Old: every FARM_* setting was Pod env, so a log level or replica change rebuilt the whole Ray cluster."""
    docs = rendered(merged(GPU, {"settings": {"engine_max_ongoing_requests": 32}, "logLevel": "DEBUG"}))
    for container in ray_containers(docs).values():
        assert {n for n in env(container) if n.startswith("FARM_")} == SECRET_ENV
    farm = serve_env(one(docs, "RayService"))
    assert (farm["FARM_ENGINE_MAX_ONGOING_REQUESTS"], farm["FARM_LOG_LEVEL"], farm["FARM_MODEL"]) == (
        "32",
        "DEBUG",
        "arith-tiny",
    )
    assert not SECRET_ENV & set(farm), "secrets stay out of the RayService"


@pytest.mark.parametrize(
    "override",
    [
        {},
        {"replicas": 3, "ingressReplicas": 2, "serve": {"front": "split"}},
        {"replicas": 3, **FUSED},
        {"replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 4, "targetOngoingRequests": 1.5}},
    ],
)
def test_deployments_agree_with_what_build_app_sets(override, monkeypatch):
    """serveConfigV2's deployments: give Serve the replica counts rollout_farm/services/serving/app.py derives from the
    same settings (an override must not disagree with the code). Old: there was no deployments: list, and so no in-place
    scaling."""
    rs = rayservice(override)
    for name, value in serve_env(rs).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FARM_API_TOKEN", "test-token-123")
    settings = ServiceSettings()
    deployments = serve_deployments(rs)
    assert {k: v for k, v in deployments["engine"].items()} == engine_scaling(settings)
    if settings.front == "split":
        assert deployments["ingress"]["num_replicas"] == settings.ingress_replicas
    else:
        assert set(deployments) == {"engine"}


def cluster_hash_view(rayservice: dict) -> dict:
    """rayClusterConfig as KubeRay 1.7.0 hashes it to decide on a new cluster (GenerateHashWithoutReplicasAndWorkers-
    ToDelete, ray-operator/controllers/ray/utils/util.go): without tolerations, scheduling gates, the worker groups'
    replicas, minReplicas, maxReplicas and workersToDelete, and the cluster's upgradeStrategy."""
    spec = json.loads(json.dumps(rayservice["spec"]["rayClusterConfig"]))
    for group in [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]:
        group["template"]["spec"].pop("tolerations", None)
        group["template"]["spec"].pop("schedulingGates", None)
    for group in spec.get("workerGroupSpecs", []):
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        group.get("scaleStrategy", {}).pop("workersToDelete", None)
    spec.pop("upgradeStrategy", None)
    return spec


def upgrade_kind(before: dict, after: dict) -> str:
    """What KubeRay does on `helm upgrade` from `before` to `after` (values overrides): "new cluster" (the hashed
    rayClusterConfig differs), "cluster scaled" (only worker counts differ: the RayCluster is updated), "in place"
    (only serveConfigV2 differs: Serve applies it on the running cluster), or "nothing"."""
    old, new = rayservice(before), rayservice(merged(before, after))
    if cluster_hash_view(old) != cluster_hash_view(new):
        return "new cluster"
    if old["spec"]["rayClusterConfig"] != new["spec"]["rayClusterConfig"]:
        return "cluster scaled"
    return "in place" if serve_config(old) != serve_config(new) else "nothing"


AUTOSCALING = {"autoscaling": {"enabled": True, "maxReplicas": 4}, "worker": {"maxReplicas": 4}}
# (the values before, the change, what KubeRay does): the table of docs/deploy.md "Upgrades".
UPGRADES = {
    "replicas": ({}, {"replicas": 3}, "in place"),
    "ingressReplicas": (SPLIT, {"ingressReplicas": 2}, "in place"),
    "serve.front": ({}, SPLIT, "in place"),
    "logLevel": ({}, {"logLevel": "DEBUG"}, "in place"),
    "model": ({}, {"model": "/data/models/other"}, "in place"),
    "engine": ({}, {"engine": "bench"}, "in place"),
    "dtype": ({}, {"dtype": "bfloat16"}, "in place"),
    "settings.*": ({}, {"settings": {"engine_max_ongoing_requests": 32}}, "in place"),
    "token.requireForGeneration": ({}, {"token": {"requireForGeneration": False}}, "in place"),
    "autoscaling.maxReplicas": (AUTOSCALING, {"autoscaling": {"maxReplicas": 3}}, "in place"),
    "autoscaling.targetOngoingRequests": (AUTOSCALING, {"autoscaling": {"targetOngoingRequests": 4}}, "in place"),
    "gpu.perReplica": (GPU, {"gpu": {"perReplica": 0.5}}, "in place"),
    "worker.replicas": ({}, {"worker": {"replicas": 2}}, "cluster scaled"),
    "worker.maxReplicas (autoscaling)": (AUTOSCALING, {"worker": {"maxReplicas": 6}}, "cluster scaled"),
    "image.tag": ({}, {"image": {"tag": "0.1.1"}}, "new cluster"),
    "head.resources": ({}, {"head": {"resources": {"limits": {"memory": "20Gi"}}}}, "new cluster"),
    "worker.resources": ({}, {"worker": {"cpus": 8}}, "new cluster"),
    "gpu.perWorker": (GPU, {"gpu": {"perWorker": 4}}, "new cluster"),
    "extraEnv": ({}, {"extraEnv": [{"name": "X", "value": "1"}]}, "new cluster"),
    "serve.httpProxy": ({}, {"serve": {"httpProxy": "serve"}}, "new cluster"),
    "storage.mountPath": ({}, {"storage": {"mountPath": "/shared"}}, "new cluster"),
    "autoscaling.enabled": ({}, {"autoscaling": {"enabled": True}}, "new cluster"),
    "token.existingSecret": ({}, {"token": {"value": "", "existingSecret": "other"}}, "new cluster"),
    "chart version only": ({}, {}, "nothing"),
}


def test_which_changes_are_applied_in_place():
    """Old: replicas, ingressReplicas, logLevel, model, engine, dtype, settings and autoscaling.* were Pod env, so each
    started a second Ray cluster (twice the GPUs meanwhile)."""
    found = {change: upgrade_kind(before, after) for change, (before, after, _) in UPGRADES.items()}
    assert found == {change: kind for change, (*_, kind) in UPGRADES.items()}


# -- Storage --------------------------------------------------------------------------------------------------------


def test_single_node_mode_keeps_every_volume_pod_on_one_node():
    """Old: no single-node mode: a ReadWriteOnce claim left Pods on other nodes unable to mount it."""
    values = merged(GPU, {"storage": {"singleNode": True}, "trainer": {"enabled": True}, "model": "/data/models/m"})
    values["modelDownload"] = {"enabled": True, "repo": "org/m"}
    docs = rendered(values)
    assert one(docs, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]
    term = {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"rollout-farm/volume": "farm"}}}
    rs = one(docs, "RayService")
    groups = [rs["spec"]["rayClusterConfig"]["headGroupSpec"], *rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    templates = [g["template"] for g in groups] + [j["spec"]["template"] for j in kinds(docs, "Job")]
    assert len(templates) == 4, "head, workers, trainer, model download"
    for template in templates:
        assert template["metadata"]["labels"]["rollout-farm/volume"] == "farm"
        assert template["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [term]
    head = pod_specs(rs)["head"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in head["tolerations"]
    assert "affinity" not in pod_specs(rayservice({}))["head"]


def test_every_volume_pod_checks_the_volume_is_writable():
    """Old: a volume the Pods' user could not write (NFS or EFS ignoring fsGroup) failed later, deep in the service."""
    docs = rendered({"trainer": {"enabled": True}})
    specs = [*pod_specs(one(docs, "RayService")).values(), one(docs, "Job")["spec"]["template"]["spec"]]
    for spec in specs:
        check = spec["initContainers"][0]
        assert check["name"] == "check-volume" and check["command"][-2:] == ["/data", "/data/weights/uploads"]
        assert check["image"] == spec["containers"][0]["image"] and "fsGroup" in check["command"][2]
    off = pod_specs(rayservice({"storage": {"checkWritable": False}}))
    assert all("initContainers" not in spec for spec in off.values())


def test_model_download_job():
    """Old: no way to get a model onto the volume from the chart."""
    values = {
        "model": "/data/models/qwen",
        "modelDownload": {
            "enabled": True,
            "repo": "Qwen/Qwen2.5-0.5B-Instruct",
            "tokenSecret": {"name": "hf", "key": "token"},
        },
    }
    docs = rendered(values)
    job = one(docs, "Job")
    assert job["metadata"]["annotations"] == {
        "helm.sh/hook": "post-install,post-upgrade",
        "helm.sh/hook-delete-policy": "before-hook-creation",
    }
    (download,) = job["spec"]["template"]["spec"]["containers"]
    assert download["image"] == "rollout-farm:0.1.0"
    assert download["command"][-4:] == [
        "Qwen/Qwen2.5-0.5B-Instruct",
        "main",
        "/data/models/qwen",
        "/data/models/qwen/.rollout-farm-download",
    ]
    assert env(download)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    wait = pod_specs(one(docs, "RayService"))["head"]["initContainers"][-1]
    assert wait["name"] == "wait-model" and wait["command"][-2:] == [
        "/data/models/qwen/.rollout-farm-download",
        "Qwen/Qwen2.5-0.5B-Instruct@main",
    ]
    assert "must be the folder on the shared volume" in render_error(merged(BASE, values | {"model": "arith-tiny"}))
    assert "modelDownload.repo" in render_error(merged(BASE, {"model": "/data/m", "modelDownload": {"enabled": True}}))


# -- The trainer Job, drains --------------------------------------------------------------------------------------


def test_trainer_job_is_replaced_by_name_and_cleaned_up():
    """Old: one fixed Job name, so a changed trainer made `helm upgrade` fail on the immutable Pod template; no TTL."""
    job = one(rendered({"trainer": {"enabled": True}}), "Job")
    name = job["metadata"]["name"]
    assert name.startswith(f"{FULLNAME}-trainer-") and len(name) == len(FULLNAME) + len("-trainer-") + 6
    assert job["spec"]["ttlSecondsAfterFinished"] == 86400
    assert one(rendered({"trainer": {"enabled": True}}), "Job")["metadata"]["name"] == name, "stable when unchanged"
    assert one(rendered({"trainer": {"enabled": True, "steps": 7}}), "Job")["metadata"]["name"] != name
    longest = one(rendered({"fullnameOverride": "r" * 47, "trainer": {"enabled": True}}), "Job")
    assert len(longest["metadata"]["name"]) <= 63, "a Job name is also a label value"


def test_disruption_budgets_priority_and_spread():
    """Old: no PodDisruptionBudget, priorityClassName or topology spread: a drain could evict the head, Redis and
    every worker at once."""
    docs = rendered(IN_CHART_REDIS | {"priorityClassName": "serving"})
    budgets = {
        d["metadata"]["name"].removeprefix(f"{FULLNAME}-"): d["spec"] for d in kinds(docs, "PodDisruptionBudget")
    }
    assert {k: v["maxUnavailable"] for k, v in budgets.items()} == {"head": 0, "worker": 1, "redis": 0}
    rs = one(docs, "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    templates = {
        "head": cluster["headGroupSpec"]["template"],
        "worker": cluster["workerGroupSpecs"][0]["template"],
        "redis": one(docs, "Deployment")["spec"]["template"],
    }
    for name, template in templates.items():
        assert budgets[name]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), name
        assert template["spec"]["priorityClassName"] == "serving", name
    spread = templates["worker"]["spec"]["topologySpreadConstraints"]
    assert spread[0]["topologyKey"] == "kubernetes.io/hostname" and spread[0]["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread[0]["labelSelector"]["matchLabels"].items() <= templates["worker"]["metadata"]["labels"].items()


# -- GPU values that add up ---------------------------------------------------------------------------------------


def test_a_gpu_fleet_adds_up():
    """The engines at the autoscaler's most fit on the most worker Pods, in GPUs and CPUs, and the head holds the
    largest upload. Old: the chart rendered engine counts no worker fleet could hold (next test)."""
    docs = rendered(GPU_FLEET)
    rs = one(docs, "RayService")
    group = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    farm = serve_env(rs)
    per_replica, cpus_per_engine = float(farm["FARM_ENGINE_NUM_GPUS"]), 1.0
    engines_per_worker = min(limits["nvidia.com/gpu"] // per_replica, float(limits["cpu"]) // cpus_per_engine)
    assert group["maxReplicas"] * engines_per_worker >= int(farm["FARM_MAX_REPLICAS"]) == 8
    assert group["minReplicas"] * engines_per_worker >= int(farm["FARM_REPLICAS"])
    assert int(farm["FARM_SGLANG_TP_SIZE"]) == per_replica, "SGLang's tensor parallelism is the GPUs an engine holds"
    assert (limits["cpu"], limits["memory"]) == ("32", "192Gi")
    head_limit = int(ray_containers(docs)["head"]["resources"]["limits"]["memory"].removesuffix("Gi")) << 30
    assert head_limit > int(GPU_FLEET["settings"]["max_weights_bytes"]) + (4 << 30)
    assert rayservice_error(rs) is None


@pytest.mark.parametrize(
    "override, message",
    [
        (
            {"autoscaling": {"maxReplicas": 9}},
            "9 engine replicas (autoscaling.maxReplicas) do not fit on 2 worker Pod(s) (4 GPU(s) per worker",
        ),
        (
            {"gpu": {"perReplica": 2}},
            "do not fit on 2 worker Pod(s) (4 GPU(s) per worker at gpu.perReplica=2): 4 fit",
        ),
        (
            {"worker": {"resources": {"limits": {"cpu": "2", "memory": "64Gi"}}}},
            "(2 CPU(s) per worker at settings.engine_num_cpus=1): 4 fit",
        ),
    ],
)
def test_gpu_values_that_do_not_add_up_are_refused(override, message):
    """Old: these rendered, and the extra engine replicas waited forever for a GPU or CPU no worker had."""
    assert message in render_error(merged(BASE, merged(GPU_FLEET, override)))


# -- Issue 40: GPU nodes: the NVIDIA runtime and the driver CUDA 13.0 needs ----------------------------------------


def init_containers(spec: dict) -> dict[str, dict]:
    return {c["name"]: c for c in spec.get("initContainers", [])}


def test_gpu_pods_get_the_runtime_class_and_the_driver_check():
    """Old (issue 40): no way to name NVIDIA's RuntimeClass where the cluster's default runtime is another, and a
    node with a driver older than CUDA 13.0's (580) took the GPU Pods, which failed later inside CUDA."""
    docs = rendered(merged(GPU, {"gpu": {"runtimeClassName": "nvidia"}, "trainer": {"enabled": True, "gpus": 1}}))
    specs = pod_specs(one(docs, "RayService"))
    trainer = one(docs, "Job")["spec"]["template"]["spec"]
    assert specs["worker"]["runtimeClassName"] == trainer["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in specs["head"], "the head uses no GPU"
    for spec, gpus, image in ((specs["worker"], 2, "rollout-farm:0.1.0-gpu"), (trainer, 1, "rollout-farm:0.1.0-gpu")):
        check = init_containers(spec)["check-driver"]
        assert check["image"] == image and check["command"][-1] == "580"
        # the Pod's own GPUs (the kubelet hands an init container's devices on to the main container)
        assert (
            check["resources"]["limits"]["nvidia.com/gpu"] == check["resources"]["requests"]["nvidia.com/gpu"] == gpus
        )
    assert "check-driver" not in init_containers(specs["head"])
    plain = rendered({"trainer": {"enabled": True, "gpus": 0}})  # no GPU anywhere: neither
    for spec in [*pod_specs(one(plain, "RayService")).values(), one(plain, "Job")["spec"]["template"]["spec"]]:
        assert "runtimeClassName" not in spec and "check-driver" not in init_containers(spec)
    assert "runtimeClassName" not in pod_specs(rayservice(GPU))["worker"], "empty: the cluster's default runtime"
    skipped = pod_specs(rayservice(merged(GPU, {"gpu": {"driverCheck": {"enabled": False}}})))["worker"]
    assert "check-driver" not in init_containers(skipped)
    newer = init_containers(pod_specs(rayservice(merged(GPU, {"gpu": {"driverCheck": {"minVersion": 590}}})))["worker"])
    assert newer["check-driver"]["command"][-1] == "590"


FAKE_SMI = """#!/bin/sh
[ "$*" = "--query-gpu=driver_version --format=csv,noheader" ] || { echo "unexpected arguments: $*" >&2; exit 2; }
{output}
"""


@pytest.mark.parametrize(
    "smi, passes, message",
    [
        ('printf "580.65.06\\n580.65.06\\n"', True, "NVIDIA driver 580.65.06 (>= 580, as CUDA 13.0 needs)"),
        ('echo "590.44.01"', True, "NVIDIA driver 590.44.01"),
        # the negative controls: an old driver on one of the GPUs, no driver, no nvidia-smi at all
        ('printf "580.82.07\\n575.57.08\\n"', False, "NVIDIA driver 575.57.08 on this node is older than 580"),
        (
            'echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver." >&2; exit 9',
            False,
            "nvidia-smi failed (exit 9): NVIDIA-SMI has failed",
        ),
        (None, False, "nvidia-smi is not in this container"),
    ],
)
def test_the_driver_check_passes_only_on_a_new_enough_driver(tmp_path, smi, passes, message):
    """The check-driver script as rendered, run here with a stand-in nvidia-smi on PATH (no GPU or NVIDIA driver on
    this machine: the stand-in prints what nvidia-smi prints for that query)."""
    worker = pod_specs(rayservice(GPU))["worker"]
    command = init_containers(worker)["check-driver"]["command"]
    if smi is not None:
        (tmp_path / "nvidia-smi").write_text(FAKE_SMI.replace("{output}", smi))
        (tmp_path / "nvidia-smi").chmod(0o755)
    path = f"{tmp_path}{os.pathsep}/usr/bin{os.pathsep}/bin"
    done = subprocess.run(
        [sys.executable, *command[1:]], capture_output=True, text=True, timeout=60, env={"PATH": path}
    )
    assert (done.returncode == 0) == passes, done.stdout + done.stderr
    assert message in done.stdout + done.stderr
    if not passes:
        assert "gpu.driverCheck.enabled=false" in done.stderr, "the way to skip it is named"


# -- Issue 40: the head's image and its disk -----------------------------------------------------------------------


def test_the_head_asks_for_the_disk_ray_spills_to():
    """Old (issue 40): no ephemeral-storage request on the head, where Ray spills the object store (uploads pass
    through it) to /tmp/ray on the container's writable layer: the scheduler could place it on a node without room,
    and the kubelet evicts the Pod that fills the node's disk first among those over their requests."""
    head = ray_containers(rendered({}))["head"]["resources"]
    assert head["requests"]["ephemeral-storage"] == "20Gi"
    assert "ephemeral-storage" not in head["limits"], "a limit would evict the head, and the cluster with it"
    spilled = 2 * ServiceSettings.model_fields["max_weights_bytes"].default  # the committed upload and the next
    assert (20 << 30) - spilled >= 4 << 30, "two of the largest uploads fit in the request, with 4 GiB for Ray's logs"


def test_the_head_runs_the_gpu_image_while_the_images_pythons_differ():
    """The CPU image is built on Python 3.11 and the GPU image on its SGLang base's (3.12), and Ray refuses a node on
    another Python, so with GPU workers the head stays on the GPU image unless head.cpuImage says they match."""
    cpu_dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    gpu_dockerfile = (ROOT / "deploy/Dockerfile.gpu").read_text()
    assert "python:3.11-slim" in cpu_dockerfile and "lmsysorg/sglang:" in gpu_dockerfile
    assert ray_containers(rendered(GPU))["head"]["image"] == "rollout-farm:0.1.0-gpu"
    assert ray_containers(rendered(merged(GPU, {"head": {"cpuImage": True}})))["head"]["image"] == "rollout-farm:0.1.0"
