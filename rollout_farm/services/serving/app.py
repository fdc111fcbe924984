"""The rollout service as a Ray Serve application: a FastAPI ingress in front of engine replicas.

HTTP ─► Ingress (rollout_farm/services/api/ingress.py; routes in rollout_farm/services/api/) ─► EngineServer × replicas
(rollout_farm/services/replica/)
              └─ weight push: header check, then stage and commit on every replica ─┘
                                                 WeightStore (deployment actor): the committed version,
                                                 loaded by a replica before it serves
Shared control-plane state (queue, request_id records, committed version, policy stats): Redis at FARM_REDIS_URL
(rollout_farm/services/state/redis_client.py; `farm serve` starts an embedded one when it is unset,
rollout_farm/services/serving/server.py).
"""

from __future__ import annotations

from ray import serve
from ray.serve.config import DeploymentActorConfig

from rollout_farm.services.api import create_api
from rollout_farm.services.api.ingress import Ingress
from rollout_farm.services.config.settings import ServiceSettings, SettingsError
from rollout_farm.services.engine import ENGINES, Engine
from rollout_farm.services.engine.auto import engine_name
from rollout_farm.services.extensions.plugins import load_plugins
from rollout_farm.services.replica.engine_server import EngineServer, request_slots, routing_queue
from rollout_farm.services.serving.fused_front import DEPLOYMENT, FusedReplica
from rollout_farm.services.state.redis_client import prefix
from rollout_farm.services.weights.store import WeightStore


def engine_class(settings: ServiceSettings) -> type[Engine]:
    """The engine FARM_ENGINE names (a FARM_PLUGINS module may register one), or SettingsError naming the variable
    and the valid names. Checked here, where the app is built, not while the settings are parsed."""
    load_plugins(settings)
    try:
        return ENGINES.get(engine_name(settings), settings.plugins)
    except (KeyError, ImportError) as e:
        raise SettingsError(f"FARM_ENGINE: {e.args[0] if e.args else e}") from None


def engine_scaling(settings: ServiceSettings) -> dict:
    """A fixed replica count, or Serve's autoscaler (on ongoing requests per replica) when FARM_MAX_REPLICAS is
    above it."""
    if settings.max_replicas <= settings.replicas:
        return {"num_replicas": settings.replicas}
    return {
        "autoscaling_config": {
            "min_replicas": settings.replicas,
            "initial_replicas": settings.replicas,
            "max_replicas": settings.max_replicas,
            "target_ongoing_requests": settings.target_ongoing_requests,
        }
    }


def build_app(settings: ServiceSettings):
    """The Serve application for these settings (FARM_REDIS_URL set: rollout_farm.services.serving.server.start sets it
    to the embedded Redis)."""
    if not settings.redis_url:
        raise SettingsError(
            "FARM_REDIS_URL is unset: point it at the Redis that holds the farm's state (redis://host:6379/0); "
            "only `farm serve` starts an embedded one"
        )
    engine_class(settings)
    pinned = {"resources": {settings.control_resource: 1}} if settings.control_resource else {}
    store = DeploymentActorConfig(
        name="weights",
        actor_class=WeightStore,
        init_args=(settings.redis_url, prefix(settings.app_name), settings.uploads_dir),
        actor_options={"num_cpus": 0, **pinned},
    )
    if (
        settings.front == "fused"
    ):  # the engine replicas serve HTTP themselves (rollout_farm/services/serving/fused_front.py)
        fused = serve.deployment(
            serve.ingress(create_api())(FusedReplica),
            name=DEPLOYMENT,
            **engine_scaling(settings),
            max_ongoing_requests=request_slots(settings) + settings.ingress_max_ongoing_requests,
            ray_actor_options={"num_cpus": settings.engine_num_cpus, "num_gpus": settings.gpus_per_engine},
            deployment_actors=[store],
        )
        return fused.bind(settings)
    engine = serve.deployment(
        EngineServer,
        name="engine",
        **engine_scaling(settings),
        max_ongoing_requests=request_slots(settings),
        max_queued_requests=routing_queue(settings),
        ray_actor_options={"num_cpus": settings.engine_num_cpus, "num_gpus": settings.gpus_per_engine},
        deployment_actors=[store],
    )
    ingress = serve.deployment(
        serve.ingress(create_api())(Ingress),
        name="ingress",
        num_replicas=settings.ingress_replicas,
        max_ongoing_requests=settings.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": 0, **pinned},
    )
    return ingress.bind(engine.bind(settings), settings)
