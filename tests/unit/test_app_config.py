"""What the service is built from, without starting it: the engine registry and settings, and the deployments'
options."""

import re

import pytest

from tests.conftest import TOKEN


def test_engines_are_registered_and_unknown_ones_are_refused_at_start_up(tiny_model):
    from rollout_farm.services.config.settings import ServiceSettings, SettingsError
    from rollout_farm.services.engine import ENGINES
    from rollout_farm.services.serving.app import engine_class

    assert {"torch", "sglang", "vllm", "bench"} <= set(ENGINES.names())
    with pytest.raises(SettingsError, match="FARM_ENGINE.*valid names: bench, sglang, torch, vllm"):
        engine_class(ServiceSettings(api_token=TOKEN, engine="tensorrt"))
    with pytest.raises(SettingsError, match="FARM_ENGINE.*FARM_PLUGINS"):  # a module not listed is never imported
        engine_class(ServiceSettings(api_token=TOKEN, engine="tests.farm_plugins:EchoEngine"))
    with pytest.raises(SettingsError, match="not a Engine subclass"):
        engine_class(
            ServiceSettings(api_token=TOKEN, engine="tests.farm_plugins:LongestOfTwo", plugins=["tests.farm_plugins"])
        )
    ok = ServiceSettings(api_token=TOKEN, engine="tests.farm_plugins:EchoEngine", plugins=["tests.farm_plugins"])
    assert engine_class(ok).__name__ == "EchoEngine"
    assert ENGINES.get(ok.engine, ok.plugins).__name__ == "EchoEngine"


def _deployments(**settings) -> dict[str, dict]:
    """What `serve build` would write for the app: deployment name -> its options as set by build_app."""
    from ray.serve._private.build_app import build_app as serve_build
    from ray.serve.deployment import deployment_to_schema

    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.serving.app import build_app

    settings.setdefault("redis_url", "redis://127.0.0.1:1/0")  # only named here: building connects to nothing
    built = serve_build(build_app(ServiceSettings(api_token=TOKEN, **settings)), name="farm")
    return {d.name: deployment_to_schema(d).model_dump(exclude_unset=True) for d in built.deployments}


def test_max_replicas_turns_on_serve_autoscaling():
    engine = _deployments(replicas=1, max_replicas=4, target_ongoing_requests=3)["engine"]
    assert "num_replicas" not in engine
    scaling = engine["autoscaling_config"]
    assert (
        scaling["min_replicas"],
        scaling["initial_replicas"],
        scaling["max_replicas"],
        scaling["target_ongoing_requests"],
    ) == (1, 1, 4, 3)


@pytest.mark.parametrize("max_replicas", [0, 2])
def test_without_headroom_the_replica_count_is_fixed(max_replicas):
    engine = _deployments(replicas=2, max_replicas=max_replicas)["engine"]
    assert engine["num_replicas"] == 2 and "autoscaling_config" not in engine


def test_ingress_replicas_is_a_setting_and_the_state_needs_a_redis():
    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.serving.app import build_app

    assert _deployments(front="split", ingress_replicas=3)["ingress"]["num_replicas"] == 3
    with pytest.raises(ValueError, match="FARM_REDIS_URL"):  # serve run / KubeRay: no embedded Redis there
        build_app(ServiceSettings(api_token=TOKEN))


def test_the_fused_front_is_one_deployment_of_engine_replicas_that_serve_http():
    """FARM_FRONT=fused (the default): no ingress deployment; the engine deployment is the app's ingress (it holds
    the routes), scaled and resourced as the engine replicas are, with room for its HTTP requests beyond the engine's
    slots."""
    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.replica.engine_server import request_slots

    fused = _deployments(replicas=3)
    assert fused == _deployments(front="fused", replicas=3) and set(fused) == {"engine"}
    engine = fused["engine"]
    assert engine["num_replicas"] == 3
    settings = ServiceSettings(api_token=TOKEN, replicas=3)
    assert engine["max_ongoing_requests"] == request_slots(settings) + settings.ingress_max_ongoing_requests
    assert set(_deployments(front="split", replicas=3)) == {"ingress", "engine"}
    with pytest.raises(ValueError, match="FARM_INGRESS_REPLICAS=2 with FARM_FRONT=fused"):  # no setting ignored
        ServiceSettings(api_token=TOKEN, front="fused", ingress_replicas=2)


@pytest.mark.parametrize(
    "settings, gpus",
    [
        ({}, 0),  # CPU: Ray hides GPUs from the replica, and there are none to hide
        ({"device": "cuda"}, 1),  # the torch engine on CUDA must reserve its GPU, or Ray hides it
        ({"engine": "sglang", "device": "cuda"}, 1),
        ({"engine": "sglang"}, 1),  # SGLang always runs on a GPU
        ({"device": "cuda", "engine_num_gpus": 0.5}, 0.5),  # two replicas share a GPU
        ({"device": "cuda:1", "engine_num_gpus": 2}, 2),
    ],
)
def test_engine_replicas_ask_ray_for_gpus_on_cuda(settings, gpus):
    for front in ("fused", "split"):
        deployments = _deployments(front=front, **settings)
        assert deployments["engine"]["ray_actor_options"]["num_gpus"] == gpus
        assert deployments["engine"]["ray_actor_options"]["num_cpus"] == 1.0
    assert deployments["ingress"]["ray_actor_options"].get("num_gpus", 0) == 0  # the split ingress never holds one


def test_the_http_proxy_setting_becomes_serves_environment(monkeypatch):
    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.serving.server import DRAIN, DRAIN_S, HAPROXY_PORTS, http_proxy_env

    for name in (*HAPROXY_PORTS, DRAIN):
        monkeypatch.delenv(name, raising=False)
    assert http_proxy_env(ServiceSettings(api_token=TOKEN, http_proxy="serve")) == {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    env = http_proxy_env(ServiceSettings(api_token=TOKEN))  # the default: haproxy
    ports = [int(env[name]) for name in HAPROXY_PORTS]  # Serve's defaults: 8404, 9101, 8500, 9500
    assert (
        env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        and len(set(ports)) == 4
        and set(ports).isdisjoint({8404, 9101, 8500, 9500})
        and env[DRAIN] == DRAIN_S != "30"  # not Ray's 30 s drain, which every stop of the service waited
    )
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")  # set by the operator: kept
    assert (
        http_proxy_env(ServiceSettings(api_token=TOKEN, http_proxy="haproxy"))["RAY_SERVE_HAPROXY_STATS_PORT"]
        == "18404"
    )
    monkeypatch.setenv(DRAIN, "12")
    assert http_proxy_env(ServiceSettings(api_token=TOKEN))[DRAIN] == "12"
    with pytest.raises(ValueError, match="http_proxy"):
        ServiceSettings(api_token=TOKEN, http_proxy="nginx")


@pytest.mark.parametrize(
    "gpus, fraction, tp",
    [(0.5, 0.45, 1), (0.25, 0.225, 1), (1, None, 1), (2, None, 2), (4, None, 4)],
)
def test_sglang_memory_and_tensor_parallelism_follow_the_gpu_share(gpus, fraction, tp):
    """Two engines on a GPU each take under half of it (SGLang's default, about 0.9 of the free memory, left the
    second engine none); an engine with 2 GPUs shards over both (tp 1 left the second idle)."""
    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.engine.sglang_engine import SGLangEngine

    settings = ServiceSettings(api_token=TOKEN, engine="sglang", device="cuda", engine_num_gpus=gpus)
    assert settings.sglang_parallelism == (fraction, tp)
    if fraction is not None:  # the engines that share one GPU fit in it together
        assert fraction * int(1 / gpus) <= 0.9
    built = {}

    class Recorded(SGLangEngine):  # SGLang needs a GPU: the engine's constructor is replaced, its factory is real
        def __init__(self, model_path, device, dtype, threads, **kw):
            built.update(kw, device=device)

    Recorded.from_settings("m", settings, None)
    assert built == {"mem_fraction_static": fraction, "tp_size": tp, "device": "cuda"}
    explicit = ServiceSettings(api_token=TOKEN, engine="sglang", engine_num_gpus=0.5, sglang_mem_fraction_static=0.3)
    assert explicit.sglang_parallelism == (0.3, 1)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"engine_num_gpus": 1.5}, "FARM_ENGINE_NUM_GPUS=1.5.*set it to 1 or 2"),
        ({"engine_num_gpus": 2, "sglang_tp_size": 4}, "FARM_SGLANG_TP_SIZE=4 differs"),
        ({"engine_num_gpus": 0.5, "sglang_tp_size": 2}, "set FARM_ENGINE_NUM_GPUS=2"),
        ({"sglang_mem_fraction_static": 1.0}, "less than 1"),
    ],
)
def test_a_gpu_share_sglang_cannot_use_is_refused_at_start(settings, message):
    from pydantic import ValidationError

    from rollout_farm.services.config.settings import ServiceSettings, explain

    with pytest.raises(ValidationError) as e:
        ServiceSettings(api_token=TOKEN, engine="sglang", **settings)
    assert re.search(message, explain(e.value)), explain(e.value)
    ServiceSettings(api_token=TOKEN, engine="torch", engine_num_gpus=1.5)  # the torch engine has no such limit


def test_the_control_resource_keeps_the_ingress_and_the_weight_store_where_it_is_offered():
    """Without it the ingress (0 CPUs) and the store could land on any node, a GPU worker included."""
    pinned = _deployments(front="split", control_resource="farm_head")
    assert pinned["ingress"]["ray_actor_options"] == {"num_cpus": 0, "resources": {"farm_head": 1}}
    for deployments in (pinned, _deployments(front="fused", control_resource="farm_head")):  # split, fused
        (store,) = deployments["engine"]["deployment_actors"]
        assert store["name"] == "weights" and store["actor_options"] == {"num_cpus": 0, "resources": {"farm_head": 1}}
    free = _deployments(front="split")
    assert free["ingress"]["ray_actor_options"] == {"num_cpus": 0}
    assert free["engine"]["deployment_actors"][0]["actor_options"] == {"num_cpus": 0}
    assert "resources" not in free["engine"]["ray_actor_options"]  # engines go where their CPUs and GPUs are
