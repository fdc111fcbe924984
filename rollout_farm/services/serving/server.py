"""Start and stop the rollout service on a local Ray cluster (used by `farm serve` and the tests)."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
from pathlib import Path

import ray
from ray import serve

from rollout_farm.services.config.settings import ServiceSettings, SettingsError
from rollout_farm.services.models import CACHE, resolve_model
from rollout_farm.services.net import free_port
from rollout_farm.services.serving.app import build_app, engine_class
from rollout_farm.services.state.embedded_redis import EmbeddedRedis

log = logging.getLogger("farm.service")
EMBEDDED: list[EmbeddedRedis] = []  # the embedded Redis this process started, stopped by stop()


def with_model_folder(settings: ServiceSettings) -> ServiceSettings:
    """The settings with FARM_MODEL as a folder (the embedded default built once here, not once per replica)."""
    if not engine_class(settings).needs_model:
        return settings
    try:
        return settings.model_copy(update={"model": str(resolve_model(settings.model))})
    except FileNotFoundError as e:
        raise SettingsError(f"FARM_MODEL={settings.model!r}: {e}") from None


def with_state(settings: ServiceSettings) -> ServiceSettings:
    """The settings with FARM_REDIS_URL: as given, or an embedded redis-server's, persisting in FARM_STATE_DIR
    (default: one folder per app and model, so another model never finds this one's committed weights)."""
    if settings.redis_url:
        return settings
    model_hash = hashlib.sha256(settings.model.encode()).hexdigest()[:8]
    folder = Path(settings.state_dir or CACHE / "state" / f"{settings.app_name}-{model_hash}")
    embedded = EmbeddedRedis(folder)
    url = embedded.start()
    EMBEDDED.append(embedded)
    return settings.model_copy(update={"redis_url": url, "state_dir": str(folder)})


HAPROXY_PORTS = (
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
)


def http_proxy_env(settings: ServiceSettings) -> dict[str, str]:
    """Serve's environment for FARM_HTTP_PROXY, read by its controller, proxies and replicas when they start (they
    inherit this process's environment). HAProxy's own stats page and metrics frontend would take ports 8404 and
    9101 on every interface, and the proxy actor that HAProxy falls back on while no replica is up 8500 and 9500:
    free ports instead, unless set, so that two services (or a trainer's metrics) share a machine. (With the
    fallback's fixed port, a second service's HAProxy sent requests to the first service's proxy actor while its own
    replicas started: the first service answered them.)"""
    if settings.http_proxy != "haproxy":
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    for name in HAPROXY_PORTS:
        env[name] = os.environ.get(name) or str(free_port("0.0.0.0"))
    return env


def start(settings: ServiceSettings, on_ray_started=lambda: None, route_prefix: str = "/") -> ServiceSettings:
    """Start Ray (if needed), the state's Redis (if embedded) and the Serve app; returns the settings with the
    model path and the Redis URL resolved. A second app (another FARM_APP_NAME) can run beside the first under its
    own route prefix."""
    settings = with_state(with_model_folder(settings))
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
    serve.shutdown()
    ray.shutdown()
    while EMBEDDED:
        EMBEDDED.pop().stop()


def run_forever(settings: ServiceSettings) -> None:
    """Serve until SIGINT or SIGTERM, then shut Serve and Ray down cleanly."""
    done = threading.Event()

    def handle_signals() -> None:  # again after ray.init, whose C++ handler would turn SIGTERM into an abort
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())

    handle_signals()
    settings = start(settings, on_ray_started=handle_signals)
    print(f"rollout service ready on http://{settings.host}:{settings.port}", flush=True)
    done.wait()
    log.info("service_stopping")
    stop()
