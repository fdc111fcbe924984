"""KubeRay's semantic validation of a RayService, ported from the operator the chart pins (KUBERAY_TAG).

The CRD schema (schemas/rayservice-v1.json) says which fields exist and their types; the operator refuses more.
Its RayService controller runs ValidateRayServiceMetadata and ValidateRayServiceSpec (which runs
ValidateRayClusterSpec) before it creates anything, and the RayCluster controller runs
ValidateRayClusterUpgradeOptions on the cluster it is given. A refused RayService gets a Warning event and no
cluster. Each function here names the Go function it ports, in ray-operator/controllers/ray/utils/validation.go at
KUBERAY_TAG unless it says otherwise, keeps KubeRay's order (the first error wins) and its messages (Go's `%v` of a
list is `[a b]`). Absent fields take the CRD's defaults, as the API server fills them in.

Feature gates are the operator's defaults at KUBERAY_TAG (pkg/features/features.go; its Helm chart sets the same),
so a field behind a gate that is off fails with KubeRay's "feature gate" error, and the checks behind those gates
(validateNetworkPolicy, validateTLSOptions, validateCollectorOptions, the rocksdb GCS backend's) never run and are
not ported. Not ported either: the RayJob and RayCronJob rules, ValidateRayClusterStatus (status, not spec), and what
only fails later, in the cluster (serveConfigV2 is parsed when KubeRay submits it to the dashboard).

KubeRay is Apache-2.0 (tests/deploy/schemas/LICENSE-Apache-2.0.txt).
"""

from __future__ import annotations

import re

from tests.deploy.go_formats import (
    dns1035_label_errors,
    generic_version,
    go_duration_sign,
    label_key_errors,
    label_value_errors,
    older,
)

KUBERAY_TAG = "v1.7.0"
KUBERAY_COMMIT = "59d663aeec13760646da3db9c1cf8cfe883e30b7"
# pkg/features/features.go defaultFeatureGates, the gates validation.go reads.
FEATURE_GATES = {
    "RayJobDeletionPolicy": True,
    "RayServiceIncrementalUpgrade": True,
    "RayClusterNetworkPolicy": False,
    "RayClusterMTLS": False,
    "RayClusterHistoryServer": False,
    "GCSFaultToleranceEmbeddedStorage": False,
}
MAX_RAYSERVICE_NAME = 53 - 6  # constant.go: MaxRayServiceNameLength = MaxRayClusterNameLength - 6
AUTOSCALER_V2_ENV = "RAY_enable_autoscaler_v2"  # constant.go RAY_ENABLE_AUTOSCALER_V2
FT_ANNOTATION = "ray.io/ft-enabled"
STORAGE_NS_ANNOTATION = "ray.io/external-storage-namespace"
TIMEOUT_ANNOTATION = "ray.io/initializing-timeout"


def rayservice_error(doc: dict) -> str | None:
    """The error KubeRay's controllers refuse the RayService `doc` with, or None when they accept it."""
    cluster = doc["spec"]["rayClusterConfig"]
    return (
        managed_by_error(doc["spec"])
        or managed_by_error(cluster)
        or metadata_error(doc["metadata"])
        or spec_error(doc)
        or cluster_upgrade_error(cluster)
    )


def managed_by_error(spec: dict) -> str | None:
    """The CRD's CEL rule on spec.managedBy and spec.rayClusterConfig.managedBy (ray.io_rayservices.yaml), which
    the API server evaluates and schemas/convert_crd.py drops."""
    if spec.get("managedBy", "ray.io/kuberay-operator") not in ("ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"):
        return "the managedBy field value must be either 'ray.io/kuberay-operator' or 'kueue.x-k8s.io/multikueue'"
    return None


def metadata_error(metadata: dict) -> str | None:
    """ValidateRayServiceMetadata."""
    name, prefix = metadata.get("name", ""), "The RayService metadata is invalid: "
    if len(name) > MAX_RAYSERVICE_NAME:
        return f"{prefix}RayService name should be no more than {MAX_RAYSERVICE_NAME} characters"
    if errs := dns1035_label_errors(name):
        return f"{prefix}RayService name should be a valid DNS1035 label: [{' '.join(errs)}]"
    if err := initializing_timeout_error(metadata.get("annotations") or {}):
        return f"{prefix}RayService annotations is invalid: {err}"
    return None


def initializing_timeout_error(annotations: dict) -> str | None:
    """validateInitializingTimeout: a positive Go duration ("5m", "1h") or a positive integer of seconds."""
    text = annotations.get(TIMEOUT_ANNOTATION, "")
    if not text:
        return None
    if (sign := go_duration_sign(text)) is not None:
        return None if sign > 0 else f"annotation {TIMEOUT_ANNOTATION} must be a positive duration, got: {text}"
    if re.fullmatch(r"[+-]?[0-9]+", text):  # strconv.Atoi
        positive = int(text) > 0
        return (
            None if positive else f"annotation {TIMEOUT_ANNOTATION} must be a positive integer (seconds), got: {text}"
        )
    return (
        f"annotation {TIMEOUT_ANNOTATION} has invalid format: {text}. "
        "Expected Go duration format (e.g., '5m', '1h') or positive integer seconds"
    )


def spec_error(doc: dict) -> str | None:
    """ValidateRayServiceSpec."""
    spec, prefix = doc["spec"], "The RayService spec is invalid: "
    cluster = spec["rayClusterConfig"]
    if (cluster.get("authOptions") or {}).get("enableK8sTokenAuth"):
        return f"{prefix}K8s token auth mode is currently not supported for RayService"
    if err := cluster_spec_error(cluster, doc["metadata"].get("annotations") or {}):
        return prefix + err
    if ((cluster["headGroupSpec"].get("headService") or {}).get("metadata") or {}).get("name"):
        return f"{prefix}spec.rayClusterConfig.headGroupSpec.headService.metadata.name should not be set"
    upgrade = spec.get("upgradeStrategy") or {}
    if upgrade.get("type") not in (None, "None", "NewCluster", "NewClusterWithIncrementalUpgrade"):
        return (
            f"{prefix}Spec.UpgradeStrategy.Type value {upgrade['type']} is invalid, valid options are "
            "NewClusterWithIncrementalUpgrade, NewCluster, or None"
        )
    if (delay := spec.get("rayClusterDeletionDelaySeconds")) is not None and delay < 0:
        return f"{prefix}Spec.RayClusterDeletionDelaySeconds should be a non-negative integer, got {delay}"
    incremental = (
        FEATURE_GATES["RayServiceIncrementalUpgrade"] and upgrade.get("type") == "NewClusterWithIncrementalUpgrade"
    )
    if incremental and (err := incremental_upgrade_error(cluster, upgrade)):
        return prefix + err
    return None


def incremental_upgrade_error(cluster: dict, upgrade: dict) -> str | None:
    """ValidateClusterUpgradeOptions."""
    if cluster.get("enableInTreeAutoscaling") is not True:
        return "Ray Autoscaler is required for NewClusterWithIncrementalUpgrade"
    if (options := upgrade.get("clusterUpgradeOptions")) is None:
        return "ClusterUpgradeOptions are required for NewClusterWithIncrementalUpgrade"
    surge, step, interval = (
        options.get("maxSurgePercent", 100),
        options.get("stepSizePercent"),
        options.get("intervalSeconds"),
    )
    if not 0 <= surge <= 100:
        return "maxSurgePercent must be between 0 and 100"
    if step is None or not 0 <= step <= 100:
        return "stepSizePercent must be between 0 and 100"
    if step > surge:
        return "stepSizePercent must be less than or equal to maxSurgePercent"
    if interval is None or interval <= 0:
        return "intervalSeconds must be greater than 0"
    if not options.get("gatewayClassName"):
        return "gatewayClassName is required for NewClusterWithIncrementalUpgrade"
    return None


def cluster_spec_error(cluster: dict, annotations: dict) -> str | None:
    """ValidateRayClusterSpec, in its order."""
    head = cluster["headGroupSpec"]
    if not head["template"]["spec"].get("containers"):
        return "headGroupSpec should have at least one container"
    head_env = head["template"]["spec"]["containers"][0].get("env") or []
    return (
        group_resources_error("Head", head)
        or group_labels_error("Head", head)
        or next(filter(None, (worker_group_error(g, cluster) for g in cluster.get("workerGroupSpecs") or [])), None)
        or gcs_fault_tolerance_error(cluster, annotations, head_env)
        or autoscaler_error(cluster, head_env)
        or gated_options_error(cluster)
    )


def group_resources_error(name: str, group: dict) -> str | None:
    """validateRayGroupResources: Ray resources in rayStartParams or in `resources`, not both."""
    params = group.get("rayStartParams") or {}
    if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
        return (
            f"resource fields should not be set in both rayStartParams and Resources for {name} group; "
            "please use only one"
        )
    return None


def group_labels_error(name: str, group: dict) -> str | None:
    """validateRayGroupLabels: no rayStartParams['labels']; `labels` are Kubernetes label keys and values."""
    if "labels" in (group.get("rayStartParams") or {}):
        return (
            f"rayStartParams['labels'] is not supported for {name} group; please use the top-level Labels field instead"
        )
    errs = []
    for key, value in (group.get("labels") or {}).items():
        errs += [f"invalid label key for {name} group: '{key}', error: {e}" for e in label_key_errors(key)]
        errs += [
            f"invalid label value for key '{key}' in {name} group: '{value}', error: {e}"
            for e in label_value_errors(value)
        ]
    return "; ".join(errs) or None


def worker_group_error(group: dict, cluster: dict) -> str | None:
    """ValidateRayClusterSpec's loop over workerGroupSpecs (minReplicas and maxReplicas take the CRD's defaults)."""
    name, low, high = group.get("groupName", ""), group.get("minReplicas", 0), group.get("maxReplicas", 2147483647)
    if not group["template"]["spec"].get("containers"):
        return "workerGroupSpec should have at least one container"
    if cluster.get("enableInTreeAutoscaling") is not True and (low is None or high is None):
        return f"worker group {name} must set both minReplicas and maxReplicas when autoscaling is disabled"
    if low is not None and low < 0:
        return f"worker group {name} has negative minReplicas {low}"
    if high is not None and high < 0:
        return f"worker group {name} has negative maxReplicas {high}"
    if low is not None and high is not None and low > high:
        return f"worker group {name} has minReplicas {low} greater than maxReplicas {high}"
    return (
        group_resources_error(name, group)
        or group_labels_error(name, group)
        or idle_timeout_error(group, cluster)
        or priority_error(group, cluster)
    )


def autoscaler_v2(cluster: dict) -> bool:
    """IsAutoscalingV2Enabled (util.go): autoscalerOptions.version is v2."""
    return (cluster.get("autoscalerOptions") or {}).get("version") == "v2"


def v2_by_env(head_env: list[dict]) -> bool:
    """The head's RAY_enable_autoscaler_v2 is "1" or "true" (the pre-1.4.0 way to ask for autoscaler v2)."""
    return (env_var(AUTOSCALER_V2_ENV, head_env) or {}).get("value") in ("1", "true")


def idle_timeout_error(group: dict, cluster: dict) -> str | None:
    """validateWorkerGroupIdleTimeout: a worker group's idleTimeoutSeconds needs autoscaler v2."""
    name, seconds = group.get("groupName", ""), group.get("idleTimeoutSeconds")
    if seconds is None:
        return None
    if seconds < 0:
        return f"worker group {name}: idleTimeoutSeconds must be non-negative, got {seconds}"
    if autoscaler_v2(cluster) or v2_by_env(head_env_of(cluster)):
        return None
    return (
        f"worker group {name}: idleTimeoutSeconds is set, but autoscaler v2 is not enabled. Please set "
        f".spec.autoscalerOptions.version to 'v2' (or set {AUTOSCALER_V2_ENV} environment variable to 'true' in the "
        "head pod if using KubeRay < 1.4.0)"
    )


def priority_error(group: dict, cluster: dict) -> str | None:
    """validateWorkerGroupPriority: a worker group's priority needs Ray >= 2.56.0 and autoscaler v2."""
    name, priority, ray = group.get("groupName", ""), group.get("priority", 0), cluster.get("rayVersion", "")
    if not priority:
        return None
    if not ray:
        return (
            f"worker group {name}: priority is set, but RayVersion was not specified. "
            "Ray version 2.56.0 or later is required"
        )
    version = generic_version(ray)
    if isinstance(version, str):
        return f"worker group {name}: priority is set, but RayVersion format is invalid: {ray}, {version}"
    if older(version, (2, 56, 0)):
        return f"worker group {name}: priority is set, but minimum Ray version is 2.56.0, got {ray}"
    if autoscaler_v2(cluster) or v2_by_env(head_env_of(cluster)):
        return None
    return (
        f"worker group {name}: priority is set to {priority}, but autoscaler v2 is not enabled. "
        "Priority is only supported with autoscaler v2 enabled"
    )


def gcs_fault_tolerance_error(cluster: dict, annotations: dict, head_env: list[dict]) -> str | None:
    """ValidateRayClusterSpec's GCS fault tolerance rules, and validateGcsFaultToleranceBackend."""
    options, params = cluster.get("gcsFaultToleranceOptions"), cluster["headGroupSpec"].get("rayStartParams") or {}
    if annotations.get(FT_ANNOTATION) and options is not None:
        return (
            f"{FT_ANNOTATION} annotation and GcsFaultToleranceOptions are both set. "
            "Please use only GcsFaultToleranceOptions to configure GCS fault tolerance"
        )
    ft_enabled = annotations.get(FT_ANNOTATION, "").lower() == "true" or options is not None
    if not ft_enabled and env_var("RAY_REDIS_ADDRESS", head_env):
        return (
            "RAY_REDIS_ADDRESS is set which implicitly enables GCS fault tolerance, but GcsFaultToleranceOptions is "
            "not set. Please set GcsFaultToleranceOptions to enable GCS fault tolerance"
        )
    if options is not None:
        conflicts = (
            (params.get("redis-password"), "`redis-password` in rayStartParams", "RedisPassword"),
            (env_var("REDIS_PASSWORD", head_env), "`REDIS_PASSWORD` env var in head Pod", "RedisPassword"),
            (env_var("RAY_REDIS_ADDRESS", head_env), "`RAY_REDIS_ADDRESS` env var in head Pod", "RedisAddress"),
            (
                annotations.get(STORAGE_NS_ANNOTATION),
                f"`{STORAGE_NS_ANNOTATION}` annotation",
                "ExternalStorageNamespace",
            ),
        )
        for found, what, instead in conflicts:
            if found:
                return (
                    f"cannot set {what} when GcsFaultToleranceOptions is enabled "
                    f"- use GcsFaultToleranceOptions.{instead} instead"
                )
        if options.get("backend") == "rocksdb" and not FEATURE_GATES["GCSFaultToleranceEmbeddedStorage"]:
            return (
                "the embedded RocksDB GCS fault tolerance backend (GcsFaultToleranceOptions.Backend: 'rocksdb') "
                "requires the GCSFaultToleranceEmbeddedStorage feature gate to be enabled"
            )
        if options.get("backend") != "rocksdb" and options.get("storage") is not None:
            return (
                "cannot set GcsFaultToleranceOptions.Storage when backend is 'redis' "
                "- it only applies to the 'rocksdb' backend"
            )
    if params.get("redis-username") or env_var("REDIS_USERNAME", head_env):
        return (
            "cannot set redis username in rayStartParams or environment variables "
            "- use GcsFaultToleranceOptions.RedisUsername instead"
        )
    return None


def autoscaler_error(cluster: dict, head_env: list[dict]) -> str | None:
    """ValidateRayClusterSpec's autoscaler rules (suspended groups, autoscaler v1/v2, autoscalerOptions)."""
    groups, options = cluster.get("workerGroupSpecs") or [], cluster.get("autoscalerOptions") or {}
    suspended = [g.get("groupName", "") for g in groups if g.get("suspend")]
    if suspended and not FEATURE_GATES["RayJobDeletionPolicy"]:
        return (
            f"worker group {suspended[0]} can be suspended only when the RayJobDeletionPolicy feature gate is enabled"
        )
    if cluster.get("enableInTreeAutoscaling") is not True:
        if v2_by_env(head_env):
            value = env_var(AUTOSCALER_V2_ENV, head_env)["value"]
            return (
                f"environment variable {AUTOSCALER_V2_ENV} cannot be set to '{value}' when enableInTreeAutoscaling is "
                "false. Please set enableInTreeAutoscaling: true to use autoscaler v2"
            )
    else:
        if suspended:
            return f"worker group {suspended[0]} cannot be suspended with Autoscaler enabled"
        if options.get("version") is not None and env_var(AUTOSCALER_V2_ENV, head_env):
            return (
                f"both .spec.autoscalerOptions.version and head Pod env var {AUTOSCALER_V2_ENV} are set, "
                "please only use the former"
            )
        if autoscaler_v2(cluster):
            if cluster["headGroupSpec"]["template"]["spec"].get("restartPolicy") not in (None, "", "Never"):
                return "restartPolicy for head Pod should be Never or unset when using autoscaler V2"
            for g in groups:
                if g["template"]["spec"].get("restartPolicy") not in (None, "", "Never"):
                    name = g.get("groupName", "")
                    return f"restartPolicy for worker group {name} should be Never or unset when using autoscaler V2"
    if (seconds := options.get("idleTimeoutSeconds")) is not None and seconds < 0:
        return f"autoscalerOptions.idleTimeoutSeconds must be non-negative, got {seconds}"
    if env_var("KUBERAY_GEN_AUTOSCALER_START_CMD", options.get("env") or []):
        return (
            "autoscalerOptions.env must not contain KUBERAY_GEN_AUTOSCALER_START_CMD: "
            "it is managed by KubeRay and injected automatically into the autoscaler container"
        )
    return None


def gated_options_error(cluster: dict) -> str | None:
    """ValidateRayClusterSpec's last rules: historyServerOptions, token auth's Ray version, networkPolicy and
    tlsOptions (the last two and the history server behind feature gates that are off by default)."""
    if cluster.get("historyServerOptions") is not None and not FEATURE_GATES["RayClusterHistoryServer"]:
        return "RayClusterHistoryServer feature gate is not enabled"
    if (cluster.get("authOptions") or {}).get("mode") == "token":  # IsAuthEnabled; K8s token auth is refused earlier
        if not (ray := cluster.get("rayVersion", "")):
            return (
                "authOptions.mode is 'token' but RayVersion was not specified. Ray version 2.52.0 or later is required"
            )
        if isinstance(version := generic_version(ray), str):
            return f"authOptions.mode is 'token' but RayVersion format is invalid: {ray}, {version}"
        if older(version, (2, 52, 0)):
            return f"authOptions.mode is 'token' but minimum Ray version is 2.52.0, got {ray}"
    if cluster.get("networkPolicy") is not None and not FEATURE_GATES["RayClusterNetworkPolicy"]:
        return "spec.networkPolicy requires the RayClusterNetworkPolicy feature gate to be enabled"
    if cluster.get("tlsOptions") is not None and not FEATURE_GATES["RayClusterMTLS"]:
        return "spec.tlsOptions requires the RayClusterMTLS feature gate to be enabled"
    return None


def cluster_upgrade_error(cluster: dict) -> str | None:
    """ValidateRayClusterUpgradeOptions on the RayCluster made from rayClusterConfig (labelled as created by a
    RayService): its own upgradeStrategy must not be set."""
    kind = (cluster.get("upgradeStrategy") or {}).get("type")
    if kind is not None and kind not in ("Recreate", "None"):
        return (
            f"The RayCluster spec is invalid: Spec.UpgradeStrategy.Type value {kind} is invalid, "
            "valid options are Recreate or None"
        )
    if kind is not None:
        return "upgradeStrategy cannot be set when RayCluster is created by RayService"
    return None


def env_var(name: str, env: list[dict]) -> dict | None:
    """EnvVarByName (util.go): the first entry of `env` named `name`."""
    return next((e for e in env if e.get("name") == name), None)


def head_env_of(cluster: dict) -> list[dict]:
    """The env of the head's Ray container (containers[RayContainerIndex], index 0)."""
    return cluster["headGroupSpec"]["template"]["spec"]["containers"][0].get("env") or []
