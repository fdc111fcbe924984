"""Start and stop the rollout service on a local Ray cluster (used by `farm serve` and the tests)."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
from pathlib import Path

import ray
import redis
from ray import serve

from rollout_farm.services.config.settings import ServiceSettings, SettingsError
from rollout_farm.services.models import CACHE, resolve_model
from rollout_farm.services.net import free_port
from rollout_farm.services.serving.app import build_app, engine_class
from rollout_farm.services.serving.haproxy_orphans import end_node_haproxies
from rollout_farm.services.serving.readiness import announce
from rollout_farm.services.state.embedded_redis import EmbeddedRedis
from rollout_farm.services.weights.store import sweep

log = logging.getLogger("farm.service")
EMBEDDED: list[EmbeddedRedis] = []  # the embedded Redis this process started, stopped by stop()
OWN_NODES: list[str] = []  # the node of the Ray cluster this process started, its leftover haproxy ended by stop()


def with_model_folder(settings: ServiceSettings) -> ServiceSettings:
    """The settings with FARM_MODEL as a folder (the embedded default built once here, not once per replica)."""
    if not engine_class(settings).needs_model:
        return settings
    try:
        return settings.model_copy(update={"model": str(resolve_model(settings.model))})
    except FileNotFoundError as e:
        raise SettingsError(f"FARM_MODEL={settings.model!r}: {e}") from None


def with_state(settings: ServiceSettings, fresh: bool = False) -> ServiceSettings:
    """The settings with FARM_REDIS_URL: as given, or an embedded redis-server's, persisting in FARM_STATE_DIR
    (default: one folder per app and model, so another model never finds this one's committed weights), with
    FARM_UPLOADS_DIR defaulting to its `uploads` folder, so that the version committed by an upload is served again
    after a restart. `fresh`: the embedded Redis's state (the committed version, the queue, request records,
    tenants) and the uploads it kept are dropped first: the farm starts at version 0, from the model folder."""
    if settings.redis_url:
        if fresh:
            raise SettingsError(
                "--fresh starts the embedded Redis empty, but FARM_REDIS_URL names a Redis this farm does not own: "
                "drop --fresh, or delete the farm's keys there yourself (the committed version is farm:<app>:weights)"
            )
        return settings
    model_hash = hashlib.sha256(settings.model.encode()).hexdigest()[:8]
    folder = Path(settings.state_dir or CACHE / "state" / f"{settings.app_name}-{model_hash}")
    uploads = str(folder / "uploads") if settings.uploads_dir is None else settings.uploads_dir
    embedded = EmbeddedRedis(folder)
    url = embedded.start()
    EMBEDDED.append(embedded)
    if fresh:
        redis.Redis.from_url(url).flushdb()
        for kept in {str(folder / "uploads"), uploads} - {""}:  # the default folder too, if uploads go elsewhere now
            sweep(Path(kept), keep=set(), older_than_s=0)
        log.info("state_dropped", extra={"state": str(folder), "uploads": uploads})
    return settings.model_copy(update={"redis_url": url, "state_dir": str(folder), "uploads_dir": uploads})


HAPROXY_PORTS = (
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
)
DRAIN = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
DRAIN_S = "5"  # Ray's default is 30 s, for a load balancer outside Ray (an AWS ALB) that must deregister the replica


def http_proxy_env(settings: ServiceSettings) -> dict[str, str]:
    """Serve's environment for FARM_HTTP_PROXY, read by its controller, proxies and replicas when they start (they
    inherit this process's environment). HAProxy's own stats page and metrics frontend would take ports 8404 and
    9101 on every interface, and the proxy actor that HAProxy falls back on while no replica is up 8500 and 9500:
    free ports instead, unless set, so that two services (or a trainer's metrics) share a machine. (With the
    fallback's fixed port, a second service's HAProxy sent requests to the first service's proxy actor while its own
    replicas started: the first service answered them.)

    A replica behind HAProxy (direct ingress) stays reachable for RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
    before it stops, then refuses new connections and finishes the requests it holds. The farm's replicas sit behind
    Serve's own HAProxy, which Serve's controller tells of a stopping replica within a second, and which retries a
    refused connection on another replica: DRAIN_S, unless set, instead of Ray's 30 s. (With 30 s every stop of
    `farm serve` waited 30 s, past serve.shutdown()'s own 30 s, so ray.shutdown() ended the HAProxy manager before it
    ended its haproxy: haproxy_orphans.py.) The Helm chart's Ray nodes do not start here: they keep Ray's 30 s."""
    if settings.http_proxy != "haproxy":
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1", DRAIN: os.environ.get(DRAIN) or DRAIN_S}
    for name in HAPROXY_PORTS:
        env[name] = os.environ.get(name) or str(free_port("0.0.0.0"))
    return env


def start(
    settings: ServiceSettings, on_ray_started=lambda: None, route_prefix: str = "/", fresh: bool = False
) -> ServiceSettings:
    """Start Ray (if needed), the state's Redis (if embedded) and the Serve app; returns the settings with the
    model path and the Redis URL resolved. A second app (another FARM_APP_NAME) can run beside the first under its
    own route prefix. `fresh`: with_state's."""
    settings = with_state(with_model_folder(settings), fresh)
    if not ray.is_initialized():
        os.environ.update(http_proxy_env(settings))
        cpus = max(os.cpu_count() or 1, int(settings.replicas * settings.engine_num_cpus) + 1)
        ray.init(
            address="local",
            num_cpus=cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            configure_logging=False,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
            _metrics_export_port=settings.ray_metrics_port,
        )
        OWN_NODES.append(ray.get_runtime_context().get_node_id())
        on_ray_started()
    serve.start(http_options={"host": settings.host, "port": settings.port}, logging_config={"log_level": "WARNING"})
    serve.run(
        build_app(settings), name=settings.app_name, route_prefix=route_prefix, logging_config={"log_level": "WARNING"}
    )
    url = f"http://{settings.host}:{settings.port}{route_prefix.rstrip('/')}"
    log.info(
        "service_ready",
        extra={"url": url, "model": settings.model, "replicas": settings.replicas, "state": settings.state_dir},
    )
    return settings


def stop() -> None:
    """Shut Serve and Ray down, end the haproxy that Serve's shutdown may have left running on the node of the Ray
    cluster this process started (haproxy_orphans.py), then stop the embedded Redis."""
    serve.shutdown()
    ray.shutdown()
    while OWN_NODES:
        if ended := end_node_haproxies(OWN_NODES.pop()):
            log.info("haproxy_orphans_ended", extra={"pids": ended})
    while EMBEDDED:
        EMBEDDED.pop().stop()


def run_forever(settings: ServiceSettings, fresh: bool = False) -> None:
    """Serve until SIGINT or SIGTERM, then shut Serve and Ray down cleanly; "rollout service ready" once /readyz
    says so (rollout_farm/services/serving/readiness.py). `fresh`: start from version 0 (with_state)."""
    done = threading.Event()

    def handle_signals() -> None:  # again after ray.init, whose C++ handler would turn SIGTERM into an abort
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())

    handle_signals()
    settings = start(settings, on_ray_started=handle_signals, fresh=fresh)
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    announce(f"http://{host}:{settings.port}", f"http://{settings.host}:{settings.port}", done)
    done.wait()
    log.info("service_stopping")
    stop()
