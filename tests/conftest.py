"""Shared fixtures: a tiny random Llama on disk, and one real Ray Serve app per test session (started only by
the tests that ask for it: tests/unit and tests/engine never start Ray).

The folders are the kinds of test, each marked by its conftest.py:
  unit/     pure functions and in-process objects: no Ray, no service, seconds    marker `unit`
  engine/   the torch engine in process, no Ray                                   marker `engine`
  service/  the real service on 127.0.0.1 (Ray Serve, two replicas of a tiny Llama)  marker `integration`
  e2e/      real processes: `farm serve`, `farm train`, torchrun, the trainer     marker `e2e`
  gpu/      CUDA and SGLang; skipped, with the reason, without a GPU             marker `gpu`
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Ray Serve keeps a replica behind HAProxy (direct ingress, the default front) reachable for a drain period before it
# stops, so that HAProxy takes it out of rotation first: Ray's 30 s, 5 s in the farm (server.py's DRAIN_S), paid by
# every app a test deletes and every service a test stops. The tests delete apps and stop services they no longer
# send to, so 2 s are enough; the processes Ray starts (and `farm serve` in tests/e2e: commands.serve_env) inherit it.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")

# FARM_CACHE is left as the user has it: by default rollout_farm/services/models.py's ~/.cache/rollout-farm, outside
# the checkout, shared by every test session and checkout (and by the user's own `farm` commands), so what is built
# or downloaded there once is reused: the default model, the sglang wheel of tests/unit/test_sglang_contract.py. The
# tests need no isolation there: whatever they cache is keyed by its version, and every service they start has its
# own state folder under pytest's tmp_path (state_dir, FARM_STATE_DIR), never FARM_CACHE/state.
TOKEN = "test-token-0123456789"
MAX_WEIGHTS_BYTES = 4 << 20  # small, so the 413 test needs no huge upload
MIN_VERSION_WAIT_S = 5.0  # short, so a rollout asking for a version nobody pushes gets its 409 soon
DISCONNECT_GRACE_S = 2.0  # short, so an abandoned rollout with a request_id frees the replicas soon
CONTEXT = 4608  # the tiny model's context: the longest generations (4096 new tokens) after a prompt of up to 512


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    from rollout_farm.services.models import tiny_llama

    path = tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", hidden=64, layers=2, seed=0, context=CONTEXT)
    tok = AutoTokenizer.from_pretrained(path)  # a chat template with roles, so tests see the messages rendered
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def service_settings(tiny_model, tmp_path_factory):
    """The session service's settings: the default front (fused: each engine replica its own HTTP ingress, behind
    HAProxy) and two engine replicas sharing the state in a real redis-server (embedded, its append-only file in a
    temporary folder). The split front (an ingress deployment, behind Serve's proxy or HAProxy): bench_service below,
    tests/service/test_fronts.py."""
    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.net import free_port

    return ServiceSettings(
        model=str(tiny_model),
        api_token=TOKEN,
        port=free_port(),
        replicas=2,
        engine_threads=1,
        max_weights_bytes=MAX_WEIGHTS_BYTES,
        engine_max_ongoing_requests=2,
        engine_max_queued_requests=2,  # small, so 429 is reachable
        min_version_wait_s=MIN_VERSION_WAIT_S,
        disconnect_grace_s=DISCONNECT_GRACE_S,
        plugins=["tests.farm_plugins"],  # a user's sampler and reward
        log_level="WARNING",  # the replicas' INFO lines would fill the test output
        state_dir=str(tmp_path_factory.mktemp("state")),
    )


@pytest.fixture(scope="session")
def service(service_settings):
    """The real service on 127.0.0.1; yields its base URL."""
    from rollout_farm.services.serving import server

    server.start(service_settings)
    yield f"http://127.0.0.1:{service_settings.port}"
    server.stop()


@pytest.fixture(scope="session")
def env_ports() -> dict[str, int]:
    """The ports the bench app lets remote environments reach (FARM_ENV_ALLOWED_HOSTS on 127.0.0.1): `openenv`, where
    tests/service/test_openenv_env.py starts its server, `mcp`, where tests/service/test_mcp_env.py starts its MCP
    server, and `down`, where nothing listens."""
    from rollout_farm.services.net import free_port

    return {"openenv": free_port(), "mcp": free_port(), "down": free_port()}


@pytest.fixture(scope="session")
def bench_service(service, env_ports, tmp_path_factory):
    """A second app in the same Serve instance, under /bench: one replica of a user engine loaded by dotted path
    (tests.farm_plugins:EchoEngine, the fixed-latency bench engine underneath), which needs no model; the split front
    with two ingress replicas; two stdio MCP servers (tests/mcp_server.py, and one that exits at once)."""
    import sys

    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.serving import server

    port = int(service.rsplit(":", 1)[1])
    settings = ServiceSettings(
        api_token=TOKEN,
        port=port,
        app_name="bench",
        engine="tests.farm_plugins:EchoEngine",
        bench_token_latency_s=0.001,
        front="split",
        ingress_replicas=2,  # tests/service/test_state.py cancels through the replica not running the rollout
        engine_num_cpus=0,
        plugins=["tests.farm_plugins"],
        env_allowed_hosts=[f"127.0.0.1:{port}" for port in env_ports.values()],
        mcp_servers={
            "tools": {"command": sys.executable, "args": [str(Path(__file__).parent / "mcp_server.py")]},
            "broken": {"command": sys.executable, "args": ["-c", "raise SystemExit(3)"]},
        },
        log_level="WARNING",
        state_dir=str(tmp_path_factory.mktemp("bench-state")),
    )
    server.start(settings, route_prefix="/bench")
    yield f"{service}/bench"
    from ray import serve

    serve.delete("bench")


@pytest.fixture
def client(service):
    from rollout_farm.services.client import FarmClient

    with FarmClient(service, TOKEN, retries=0) as c:
        yield c


@pytest.fixture
def fresh_weights(client, tiny_model):
    """Push the model folder's own safetensors as a new version, so the service serves the on-disk weights."""
    version = client.weights_version().version + 1
    client.push_weights((tiny_model / "model.safetensors").read_bytes(), version)
    return version


def mark_folder(items, conftest_file: str, marker: str) -> None:
    """Give every test under the folder of `conftest_file` the marker (each folder's conftest.py calls this)."""
    folder = Path(conftest_file).parent
    for item in items:
        if item.path.is_relative_to(folder):
            item.add_marker(marker)


def pytest_collection_modifyitems(config, items):
    """Skip the `gpu` tests, with the reason, where torch sees no CUDA device (after the folders' markers)."""
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
