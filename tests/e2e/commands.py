"""The commands the end-to-end tests run as real processes."""

import os
import signal
import subprocess
import sys

from rollout_farm.services.net import free_port
from rollout_farm.services.serving.server import DRAIN
from tests.conftest import TOKEN


def farm_train(service: str, model, *args: str, launcher: tuple[str, ...] = (sys.executable,)) -> list[str]:
    """`farm train` (python -m rollout_farm.trainer.cli train) against `service` with the model folder `model`, then
    `args`."""
    return [
        *launcher,
        "-m",
        "rollout_farm.trainer.cli",
        "train",
        "--service-url",
        service,
        "--model",
        str(model),
        *args,
    ]


def serve_env(model, tmp_path, **farm) -> dict[str, str]:
    """The environment of a `farm serve` of its own: a free port, the token, the model, one torch thread, a state
    folder under tmp_path, no FARM_REDIS_URL (its own embedded Redis), then the FARM_ settings given (names without
    the prefix, e.g. replicas="2"). Nothing of the session service's Ray: its RAY_SERVE_* variables (the ports of its
    HAProxy's stats and metrics and of the proxy HAProxy falls back on, which server.start sets in this process)
    would make the new service's HAProxy bind the same ports and fail, or fall back on the session service. Except
    the replicas' short drain (tests/conftest.py), so that each stop of the service takes seconds."""
    env = {k: v for k, v in os.environ.items() if k != "FARM_REDIS_URL" and not k.startswith("RAY_SERVE_")}
    env[DRAIN] = os.environ[DRAIN]
    env |= {"FARM_API_TOKEN": TOKEN, "FARM_PORT": str(free_port()), "FARM_MODEL": str(model)}
    env |= {"FARM_ENGINE_THREADS": "1", "FARM_STATE_DIR": str(tmp_path / "state")}
    return env | {f"FARM_{k.upper()}": v for k, v in farm.items()}


def farm_serve(env: dict, *args: str) -> subprocess.Popen:
    """`farm serve` (python -m rollout_farm.trainer.cli serve), then `args`, with this environment; its output in
    proc.stdout."""
    cmd = [sys.executable, "-m", "rollout_farm.trainer.cli", "serve", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM to a `farm serve`, then its output once it exited (proc.returncode: 0 for a clean stop)."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return out
