"""Start and stop the rollout service on a local Ray cluster (used by `farm serve` and the tests)."""

from __future__ import annotations

import logging
import os
import signal
import threading

import ray
from ray import serve

from services.app import build_app
from services.engine import ENGINES
from services.models import resolve_model
from services.settings import ServiceSettings

log = logging.getLogger("farm.service")


def with_model_folder(settings: ServiceSettings) -> ServiceSettings:
    """The settings with FARM_MODEL as a folder (the embedded default built once here, not once per replica)."""
    if not ENGINES.get(settings.engine, settings.plugins).needs_model:
        return settings
    return settings.model_copy(update={"model": str(resolve_model(settings.model))})


def start(settings: ServiceSettings, on_ray_started=lambda: None, route_prefix: str = "/") -> ServiceSettings:
    """Start Ray (if needed) and the Serve app; returns the settings with the model path resolved. A second app
    (another FARM_APP_NAME) can run beside the first under its own route prefix."""
    settings = with_model_folder(settings)
    if not ray.is_initialized():
        cpus = max(os.cpu_count() or 1, int(settings.replicas * settings.engine_num_cpus) + 1)
        ray.init(
            address="local",
            num_cpus=cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            configure_logging=False,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
        )
        on_ray_started()
    serve.start(http_options={"host": settings.host, "port": settings.port}, logging_config={"log_level": "WARNING"})
    serve.run(
        build_app(settings), name=settings.app_name, route_prefix=route_prefix, logging_config={"log_level": "WARNING"}
    )
    url = f"http://{settings.host}:{settings.port}{route_prefix.rstrip('/')}"
    log.info("service_ready", extra={"url": url, "model": settings.model, "replicas": settings.replicas})
    return settings


def stop() -> None:
    serve.shutdown()
    ray.shutdown()


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
