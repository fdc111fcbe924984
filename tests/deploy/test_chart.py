"""helm/rollout-farm rendered for several value sets: strict lint, kubernetes-validate on core kinds, check-jsonschema
on the custom resources (KubeRay's and Prometheus Operator's CRD schemas, vendored in schemas/), what the values do,
and bad values failing with a clear message."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from rollout_farm.services.config.settings import ServiceSettings
from tests.deploy.chart_render import (
    BASE,
    CHART,
    CRD_SCHEMAS,
    FULLNAME,
    ROOT,
    all_containers,
    check_jsonschema,
    documented_values,
    env,
    lint_findings,
    merged,
    notes,
    one,
    pod_specs,
    pod_templates,
    ray_containers,
    render,
    render_error,
    serve_app,
    serve_config,
    serve_env,
    validate_core,
)
from tests.deploy.farm_env import assert_known_farm_vars
from tests.deploy.kuberay_validation import rayservice_error

MONITORING = {k: {"enabled": True} for k in ("serviceMonitor", "podMonitor", "prometheusRule", "dashboard")}
# The GPU installs of docs/deploy.md and the chart README (token Secret, in-chart Redis: BASE's token and Redis URL
# emptied), as a values file gives them: `--set gpu.perReplica=0.5` gives the string "0.5", which the schema refuses.
README_GPU_INSTALL = {
    "token": {"value": "", "existingSecret": "farm-token"},
    "gpu": {"enabled": True, "perWorker": 2, "perReplica": 0.5},
    "dtype": "bfloat16",
    "replicas": 2,
    "autoscaling": {"enabled": True, "maxReplicas": 16},
    "worker": {"maxReplicas": 4},
    "redis": {"url": "", "inChart": {"enabled": True}},
    "gcsFaultTolerance": {"enabled": True},
    "monitoring": MONITORING,
}
DOCS_GPU_INSTALL = README_GPU_INSTALL | {
    "engine": "sglang",
    "model": "/data/models/Qwen2.5-0.5B-Instruct",
    "settings": {"sglang_mem_fraction_static": 0.4},
}
VALUE_SETS = {
    "default": {},
    "gpu-workers": {
        "gpu": {"enabled": True, "perWorker": 2, "perReplica": 0.5, "runtimeClassName": "nvidia"},
        "dtype": "bfloat16",
    },
    "autoscaling": {
        "replicas": 2,
        "autoscaling": {"enabled": True, "maxReplicas": 8, "targetOngoingRequests": 1.5},
        "worker": {"minReplicas": 1, "maxReplicas": 6},
        "settings": {"max_weights_bytes": 17179869184, "plugins": ["my_pkg.rewards"], "engine_num_cpus": 2},
        "head": {"resources": {"limits": {"memory": "24Gi"}, "requests": {"memory": "24Gi"}}},
    },
    "existing-secret": {"token": {"value": "", "existingSecret": "farm-api", "key": "api-token"}},
    "created-secret": {"token": {"value": "a-much-longer-token", "key": "tok"}},
    "trainer": {"trainer": {"enabled": True, "gpus": 1, "steps": 7, "overrides": {"actor_rollout_ref.rollout.n": 16}}},
    "monitoring": {"monitoring": MONITORING, "trainer": {"enabled": True}},
    "redis-gcs-ft": {"redis": {"url": "", "inChart": {"enabled": True}}, "gcsFaultTolerance": {"enabled": True}},
    "split-serve": {"serve": {"front": "split", "httpProxy": "serve"}},
    "docs-gpu-install": DOCS_GPU_INSTALL,
    "readme-gpu-install": README_GPU_INSTALL,
    # issue 27's modes together: one GPU node (ReadWriteOnce), SGLang sharing GPUs, the model downloaded, the trainer,
    # the in-chart Redis with GCS fault tolerance, KubeRay's token auth, a priority class
    "single-node-hardened": {
        "gpu": {"enabled": True, "perWorker": 2, "perReplica": 0.5},
        "engine": "sglang",
        "replicas": 4,
        "model": "/data/models/qwen",
        "settings": {"sglang_mem_fraction_static": 0.4},
        "modelDownload": {
            "enabled": True,
            "repo": "Qwen/Qwen2.5-0.5B-Instruct",
            "tokenSecret": {"name": "hf", "key": "t"},
        },
        "storage": {"singleNode": True},
        "trainer": {"enabled": True, "gpus": 0},
        "redis": {"url": "", "inChart": {"enabled": True}},
        "gcsFaultTolerance": {"enabled": True},
        "rayAuth": {"enabled": True},
        "priorityClassName": "serving",
    },
}
VALUES = {name: merged(BASE, v) for name, v in VALUE_SETS.items()}
RENDERED = {name: render(v) for name, v in VALUES.items()}
CUSTOM_KINDS = {"RayService", "ServiceMonitor", "PodMonitor", "PrometheusRule"}


def rayservice(name: str) -> dict:
    return one(RENDERED[name], "RayService")


def containers(name: str) -> dict[str, dict]:
    return ray_containers(RENDERED[name])


@pytest.mark.parametrize("name", VALUE_SETS)
def test_strict_lint_passes(name):
    assert lint_findings(VALUES[name]) == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_core_kinds_validate_strictly(name):
    docs = [d for d in RENDERED[name] if d["kind"] not in CUSTOM_KINDS] + pod_templates(rayservice(name))
    for doc in docs:
        validate_core(doc)  # raises kubernetes_validate.ValidationError naming the path


def test_custom_resources_match_their_crds():
    for kind, schema in CRD_SCHEMAS.items():
        docs = [d for docs in RENDERED.values() for d in docs if d["kind"] == kind]
        assert docs, kind
        result = check_jsonschema(schema, docs)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", VALUE_SETS)
def test_kuberay_accepts_the_rayservice(name):
    """The semantic checks of the pinned KubeRay operator (kuberay_validation.py), beyond its CRD schema."""
    assert rayservice_error(rayservice(name)) is None


WORKER_CONTAINER = ("spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec", "containers", 0)


@pytest.mark.parametrize(
    "path, typo",
    [(("spec", "rayClusterConfig"), "enableInTreeAutoscalling"), (WORKER_CONTAINER, "readinesProbe")],
)
def test_crd_schema_rejects_a_misspelled_field(path, typo):
    doc = json.loads(json.dumps(rayservice("default")))
    node = doc
    for key in path:
        node = node[key]
    node[typo] = {}
    result = check_jsonschema(CRD_SCHEMAS["RayService"], [doc])
    assert result.returncode != 0 and typo in result.stdout, result.stdout


def test_ray_version_follows_the_lock():
    pin = re.search(r"^ray==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M).group(1)
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart_values["rayVersion"] == pin, "bump values.yaml rayVersion with the ray pin of requirements.lock"
    assert rayservice("default")["spec"]["rayClusterConfig"]["rayVersion"] == pin


def test_default_layout():
    rs = rayservice("default")
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert cluster["enableInTreeAutoscaling"] is False
    group = cluster["workerGroupSpecs"][0]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
    app = serve_app(rs)
    assert (app["name"], app["import_path"], app["route_prefix"]) == (
        "farm",
        "rollout_farm.services.serving.serve_entry:app",
        "/",
    )
    assert serve_config(rs)["http_options"]["port"] == 8000
    head, worker = containers("default").values()
    assert env(head) == env(worker), "head and workers get the same Pod env"
    settings = serve_env(rs)
    assert settings["FARM_MAX_REPLICAS"] == "0" and env(head)["FARM_REDIS_URL"] == "redis://redis.db:6379/0"
    # the HTTP front: the fused one behind HAProxy unless serve.front and serve.httpProxy say otherwise; HAProxy is set
    # on every Ray node (Serve reads it when Ray starts); the fused front is one deployment, the engine's
    assert (settings["FARM_FRONT"], settings["FARM_HTTP_PROXY"], env(head)["RAY_SERVE_ENABLE_HA_PROXY"]) == (
        "fused",
        "haproxy",
        "1",
    )
    assert [(d["name"], d.get("num_replicas")) for d in serve_app(rs)["deployments"]] == [("engine", 1)]
    split = rayservice("split-serve")
    assert (serve_env(split)["FARM_FRONT"], serve_env(split)["FARM_HTTP_PROXY"]) == ("split", "serve")
    assert [(d["name"], d.get("num_replicas")) for d in serve_app(split)["deployments"]] == [
        ("ingress", 1),
        ("engine", 1),
    ]
    for c in containers("split-serve").values():
        assert env(c)["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    # ingress replicas with the fused front would be a setting ignored: the render fails, naming both values
    assert "ingressReplicas=2 with serve.front=fused" in render_error(merged(BASE, {"ingressReplicas": 2}))
    assert all({"name": "serve", "containerPort": 8000} in c["ports"] for c in (head, worker))
    # Probes: Ray's node health for liveness (and the head's readiness: KubeRay deploys Serve once the head is Ready);
    # the node's Serve proxy for a worker's readiness.
    for c in (head, worker):
        assert c["livenessProbe"]["httpGet"] == {"path": "/api/healthz", "port": 52365}
        assert c["livenessProbe"]["failureThreshold"] * c["livenessProbe"]["periodSeconds"] >= 300
    assert head["readinessProbe"]["httpGet"] == {"path": "/api/healthz", "port": 52365}
    assert worker["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": "serve"}


def test_probes_can_be_overridden():
    values = merged(BASE, {"worker": {"readinessProbe": {"httpGet": {"path": "/readyz"}, "failureThreshold": 12}}})
    probe = ray_containers(render(values))["worker"]["readinessProbe"]
    assert probe["httpGet"] == {"path": "/readyz", "port": "serve"} and probe["failureThreshold"] == 12


def test_shared_volume_on_head_and_workers():
    claim = one(RENDERED["default"], "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for role, spec in pod_specs(rayservice("default")).items():
        (volume,) = spec["volumes"]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"], role
        (mount,) = spec["containers"][0]["volumeMounts"]
        assert mount == {"name": volume["name"], "mountPath": "/data"}, role
    farm = serve_env(rayservice("default"))
    assert farm["FARM_WEIGHTS_DIR"].startswith("/data/") and farm["FARM_CACHE"].startswith("/data/")
    existing = render(merged(BASE, {"storage": {"existingClaim": "weights"}}))
    assert not [d for d in existing if d["kind"] == "PersistentVolumeClaim"]
    assert {
        s["volumes"][0]["persistentVolumeClaim"]["claimName"] for s in pod_specs(one(existing, "RayService")).values()
    } == {"weights"}


def test_gpu_workers():
    head, worker = containers("gpu-workers").values()
    for part in ("requests", "limits"):
        assert worker["resources"][part]["nvidia.com/gpu"] == 2
        assert "nvidia.com/gpu" not in head["resources"].get(part, {})
    farm = serve_env(rayservice("gpu-workers"))
    assert (farm["FARM_DEVICE"], farm["FARM_ENGINE_NUM_GPUS"], farm["FARM_DTYPE"]) == ("cuda", "0.5", "bfloat16")
    assert env(head) == env(worker)
    # the head joins the workers' cluster, and Ray refuses a node on another Python: the same image by default
    assert worker["image"] == head["image"] == "rollout-farm:0.1.0-gpu"
    spec = pod_specs(rayservice("gpu-workers"))["worker"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert rayservice("gpu-workers")["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert "FARM_ENGINE_NUM_GPUS" not in serve_env(rayservice("default"))


def test_autoscaling():
    cluster = rayservice("autoscaling")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["upscalingMode"] == "Default"
    assert cluster["autoscalerOptions"]["version"] == "v2"  # KubeRay >= 1.6 needs it for the group's idle timeout
    group = cluster["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 6)
    farm = serve_env(rayservice("autoscaling"))
    assert (farm["FARM_REPLICAS"], farm["FARM_MAX_REPLICAS"], farm["FARM_TARGET_ONGOING_REQUESTS"]) == ("2", "8", "1.5")
    # numbers stay integers (helm reads values as floats: no 1.7179869184e+10), lists are JSON
    assert farm["FARM_MAX_WEIGHTS_BYTES"] == "17179869184" and farm["FARM_ENGINE_NUM_CPUS"] == "2"
    assert json.loads(farm["FARM_PLUGINS"]) == ["my_pkg.rewards"]
    # remote environments: none unless listed (FARM_ENV_ALLOWED_HOSTS), a list as JSON
    assert json.loads(serve_env(rayservice("default"))["FARM_ENV_ALLOWED_HOSTS"]) == []
    listed = serve_env(
        one(render(merged(BASE, {"environments": {"allowedHosts": ["envs.ns.svc:8000"]}})), "RayService")
    )
    assert json.loads(listed["FARM_ENV_ALLOWED_HOSTS"]) == ["envs.ns.svc:8000"]
    assert "allowedHosts" in render_error(merged(BASE, {"environments": {"allowedHosts": ["no-port"]}}))
    # stdio MCP servers: none unless configured (FARM_MCP_SERVERS), a map as JSON that the service's settings read
    assert json.loads(serve_env(rayservice("default"))["FARM_MCP_SERVERS"]) == {}
    files = {"files": {"command": "mcp-server-filesystem", "args": ["/data"], "env": {"LOG": "0"}}}
    configured = serve_env(one(render(merged(BASE, {"environments": {"mcpServers": files}})), "RayService"))
    assert json.loads(configured["FARM_MCP_SERVERS"]) == files
    assert ServiceSettings(api_token="t" * 12, mcp_servers=json.loads(configured["FARM_MCP_SERVERS"])).mcp_servers
    for bad in ({"files": {"args": []}}, {"two words": {"command": "x"}}, {"files": {"command": "x", "shell": True}}):
        assert "mcpServers" in render_error(merged(BASE, {"environments": {"mcpServers": bad}}))


def test_every_farm_variable_is_a_setting():
    fields = set(ServiceSettings.model_fields)
    containers = [c for docs in RENDERED.values() for doc in docs for c in all_containers(doc)]
    assert_known_farm_vars({name for c in containers for name in env(c)}, "the chart")
    assert_known_farm_vars({var for name in VALUES for var in serve_env(rayservice(name))}, "serveConfigV2")
    settings_schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["settings"]
    own_values = {"model", "api_token", "replicas", "max_replicas", "target_ongoing_requests", "engine", "device"}
    own_values |= {"require_token_for_generation", "dtype", "ingress_replicas", "log_level", "http_proxy", "front"}
    own_values |= {"env_allowed_hosts", "mcp_servers"}
    managed = {"redis_url", "weights_dir", "uploads_dir", "app_name", "sglang_tp_size"}
    assert set(settings_schema["properties"]) <= fields - own_values - managed


def test_token_secret_created_or_referenced():
    created = one(RENDERED["created-secret"], "Secret")
    assert created["stringData"] == {"tok": "a-much-longer-token"}
    ref = {"secretKeyRef": {"name": created["metadata"]["name"], "key": "tok"}}
    assert all(env(c)["FARM_API_TOKEN"] == ref for c in containers("created-secret").values())
    assert not [d for d in RENDERED["existing-secret"] if d["kind"] == "Secret"]
    ref = {"secretKeyRef": {"name": "farm-api", "key": "api-token"}}
    assert all(env(c)["FARM_API_TOKEN"] == ref for c in containers("existing-secret").values())
    assert "secret farm-api -o jsonpath='{.data.api-token}'" in notes(VALUES["existing-secret"])


def test_trainer_job():
    job = one(RENDERED["trainer"], "Job")
    spec = job["spec"]["template"]["spec"]
    (check, driver, wait), (trainer,) = spec["initContainers"], spec["containers"]
    assert (check["name"], driver["name"]) == ("check-volume", "check-driver"), "a GPU trainer checks the driver"
    url = f"http://{FULLNAME}-serve-svc:8000"
    assert wait["command"][-2] == url and "/readyz" in wait["command"][2]
    args = trainer["args"]
    assert args[:2] == ["farm", "train"] and args[args.index("--service-url") + 1] == url
    assert args[args.index("--steps") + 1] == "7" and args[args.index("--out") + 1] == "/data/runs/farm"
    assert {"trainer.metrics_port=9100", "actor_rollout_ref.rollout.n=16"} <= set(args)
    assert "trainer.push_dir=/data/weights/steps" in args  # by path through the shared volume, inside FARM_WEIGHTS_DIR
    assert trainer["ports"] == [{"name": "metrics", "containerPort": 9100}]
    assert env(trainer)["FARM_API_TOKEN"] == {"secretKeyRef": {"name": f"{FULLNAME}-token", "key": "token"}}
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["volumes"] == pod_specs(rayservice("trainer"))["worker"]["volumes"]


def test_the_trainer_job_uploads_when_its_overrides_say_so():
    """Negative control of the default push by path: an override of trainer.push_dir replaces it."""
    values = merged(BASE, {"trainer": {"enabled": True, "overrides": {"trainer.push_dir": ""}}})
    (trainer,) = one(render(values), "Job")["spec"]["template"]["spec"]["containers"]
    assert [a for a in trainer["args"] if a.startswith("trainer.push_dir")] == ["trainer.push_dir="]


def test_the_trainer_job_uploads_with_a_diffing_weight_sync():
    """The trainer refuses push_dir with bucketed or delta (they diff against the last upload), so the Job's default
    push by path must step aside for them, or every retry of the Job would fail at its start; full keeps it."""
    for mode, by_path in (("delta", False), ("bucketed", False), ("full", True)):
        values = merged(BASE, {"trainer": {"enabled": True, "overrides": {"trainer.weight_sync": mode}}})
        (trainer,) = one(render(values), "Job")["spec"]["template"]["spec"]["containers"]
        assert any(a.startswith("trainer.push_dir=") for a in trainer["args"]) == by_path, mode


def test_monitoring():
    docs = RENDERED["monitoring"]
    sm = one(docs, "ServiceMonitor")["spec"]
    assert sm["selector"]["matchLabels"]["ray.io/serve"] == f"{FULLNAME}-serve"
    assert (sm["endpoints"][0]["port"], sm["endpoints"][0]["path"]) == ("serve", "/metrics")
    ray, trainer = (d["spec"] for d in docs if d["kind"] == "PodMonitor")
    assert ray["podMetricsEndpoints"][0]["port"] == trainer["podMetricsEndpoints"][0]["port"] == "metrics"
    assert all({"name": "metrics", "containerPort": 8080} in c["ports"] for c in containers("monitoring").values())
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert one(docs, "PrometheusRule")["spec"]["groups"] == alerts["groups"]
    dashboard, file = one(docs, "ConfigMap"), CHART / "files" / "dashboard.json"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["rollout-farm.json"]) == json.loads(file.read_text())
    label = {"enabled": True, "labelName": "dash", "labelValue": "yes"}
    assert (
        one(render(merged(BASE, {"monitoring": {"dashboard": label}})), "ConfigMap")["metadata"]["labels"]["dash"]
        == "yes"
    )
    assert not {d["kind"] for d in RENDERED["default"]} & (CUSTOM_KINDS - {"RayService"} | {"ConfigMap"})


def test_in_chart_redis_and_gcs_fault_tolerance():
    docs = RENDERED["redis-gcs-ft"]
    redis = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert redis["image"].startswith("redis:") and "--appendonly" in redis["args"]
    service = one(docs, "Service")
    url = env(containers("redis-gcs-ft")["head"])["FARM_REDIS_URL"]
    assert url == f"redis://:$(ROLLOUT_FARM_REDIS_PASSWORD)@{service['metadata']['name']}:6379/0"
    ft = rayservice("redis-gcs-ft")["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    password = {"valueFrom": {"secretKeyRef": {"name": f"{FULLNAME}-redis", "key": "password"}}}
    assert ft == {"redisAddress": f"{service['metadata']['name']}:6379", "redisPassword": password}
    external = merged(BASE, {"gcsFaultTolerance": {"enabled": True, "redisPasswordSecret": {"name": "r", "key": "pw"}}})
    ft = one(render(external), "RayService")["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    password = {"valueFrom": {"secretKeyRef": {"name": "r", "key": "pw"}}}
    assert ft == {"redisAddress": "redis.db:6379", "redisPassword": password}
    assert "gcsFaultToleranceOptions" not in rayservice("default")["spec"]["rayClusterConfig"]


NO_TOKEN = {"redis": {"url": "redis://r:6379/0"}}
BAD_VALUES = {
    "no token": (NO_TOKEN, "token: set token.existingSecret"),
    "empty token": (merged(BASE, {"token": {"value": ""}}), "token: set token.existingSecret"),
    "short token": (merged(BASE, {"token": {"value": "short"}}), "at least 8 characters"),
    "two tokens": (merged(BASE, {"token": {"existingSecret": "s"}}), "not both"),
    "string replicas": (merged(BASE, {"replicas": "2"}), "at '/replicas': got string, want integer"),
    "negative replicas": (merged(BASE, {"replicas": -1}), "at '/replicas': minimum: got -1, want 1"),
    "negative workers": (merged(BASE, {"worker": {"replicas": -1}}), "at '/worker/replicas': minimum"),
    "gpu with 0 gpus": (merged(BASE, {"gpu": {"enabled": True, "perWorker": 0}}), "at '/gpu/perWorker': minimum"),
    "replica larger than a worker": (merged(BASE, {"gpu": {"enabled": True, "perReplica": 2}}), "gpu.perReplica (2)"),
    "no redis": ({"token": BASE["token"]}, "redis: the service keeps its state in Redis"),
    "two redis": (merged(BASE, {"redis": {"inChart": {"enabled": True}}}), "redis: give either redis.url"),
    "autoscale to fewer": (merged(BASE, {"autoscaling": {"enabled": True, "maxReplicas": 1}}), "must exceed replicas"),
    "unknown setting": (merged(BASE, {"settings": {"engine_max_ongoing": 3}}), "'engine_max_ongoing' not allowed"),
    "managed setting": (merged(BASE, {"settings": {"redis_url": "x"}}), "'redis_url' not allowed"),
    "long name": (merged(BASE, {"fullnameOverride": "r" * 48}), "at most 47"),
    "sglang on cpus": (merged(BASE, {"engine": "sglang"}), "sglang runs on GPUs"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_fail_clearly(case):
    values, message = BAD_VALUES[case]
    assert message in render_error(values)


@pytest.mark.parametrize("file, toggle", [("alerts.yaml", "prometheusRule"), ("dashboard.json", "dashboard")])
def test_missing_monitoring_file_fails_clearly(tmp_path, file, toggle):
    chart = shutil.copytree(CHART, tmp_path / "rollout-farm")
    (chart / "files" / file).unlink()
    error = render_error(merged(BASE, {"monitoring": {toggle: {"enabled": True}}}), chart=chart)
    assert f"no files/{file}" in error


def test_every_value_is_documented():
    documented, undocumented = documented_values((CHART / "values.yaml").read_text())
    assert not undocumented, f"values without a # -- comment: {undocumented}"
    readme = (CHART / "README.md").read_text()
    assert not [key for key in documented if f"| `{key}` |" not in readme], "README.md's values table is behind"
