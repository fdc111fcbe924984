"""The `farm` entry points as real processes: `farm serve`, `farm train`, and the CLI against a service."""

import json
import os
import subprocess
import sys

import psutil
from transformers import AutoModelForCausalLM

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from rollout_farm.services.weights.pusher import WeightPusher
from rollout_farm.trainer.sync.weights import push_weights
from tests.conftest import TOKEN
from tests.e2e.commands import farm_serve, farm_train, serve_env, stop

GREEDY = P.RolloutRequest(
    prompts=[P.Prompt(text="Q: 12+3\nA:", ground_truth="15")],
    n=1,
    sampling_params=P.SamplingParams(temperature=0, max_new_tokens=8),
)


def test_trainer_runs_two_steps_and_pushes_two_versions(service, client, fresh_weights, tiny_model, tmp_path):
    before = client.rollouts(GREEDY).groups[0].samples[0]
    cmd = farm_train(
        service,
        tiny_model,
        *"--task arith --steps 2 --train-batch-size 4 --n 4 --ppo-mini-batch-size 2 --lr 0.01".split(),
        *"--entropy-coeff 0.05 --out".split(),
        str(tmp_path),
    )
    proc = subprocess.run(cmd, env={**os.environ, "FARM_API_TOKEN": TOKEN}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["grad_norm"] > 0 for s in steps)
    assert {"reward_mean", "reward_std", "kl_ref", "entropy", "step_seconds", "tokens_per_s"} <= set(steps[0])
    summary = json.loads((tmp_path / "summary.json").read_text())
    # the trainer started from the served version; it must be told that it is not version 0
    assert (
        summary["final_weight_version"] == fresh_weights + 3 == client.weights_version().version
    )  # initial sync + 2 steps
    after = client.rollouts(GREEDY).groups[0].samples[0]
    assert after.weight_version == fresh_weights + 3
    assert after.logprobs[:1] != before.logprobs[:1]  # the served parameters changed


def test_farm_serve_starts_serves_and_stops_cleanly(tiny_model, tmp_path):
    env = serve_env(tiny_model, tmp_path)
    port = env["FARM_PORT"]
    proc = farm_serve(env)
    try:
        url = f"http://127.0.0.1:{port}"
        with FarmClient(url, TOKEN) as c:
            c.wait_ready(timeout_s=180)
            assert len(c.rollouts(GREEDY).groups[0].samples) == 1 and c.weights_version().version == 0
            cmd = farm_train(
                url,
                tiny_model,
                *"--steps 2 --train-batch-size 4 --n 4 --entropy-coeff 0.05 --lr 0.01 --out".split(),
                str(tmp_path),
            )
            train = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            assert train.returncode == 0, train.stderr[-3000:]
            assert c.weights_version().version == 2  # a fresh service: two steps, two versions
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "service_stopping" in out


def test_farm_serve_behind_haproxy_serves_rollouts_and_uploads(tiny_model, tmp_path):
    """FARM_HTTP_PROXY=haproxy: Ray Serve's HAProxy ingress answers on FARM_PORT (an haproxy process of this
    service's, gone after it stops), rollouts and a streamed weight upload pass through it, and HAProxy's own stats
    and metrics ports are free ones, so it starts beside another service's."""
    env = serve_env(tiny_model, tmp_path, http_proxy="haproxy")
    port = env["FARM_PORT"]
    proc = farm_serve(env)
    try:
        with FarmClient(f"http://127.0.0.1:{port}", TOKEN) as c:
            c.wait_ready(timeout_s=180)
            haproxy = [p for p in psutil.Process(proc.pid).children(recursive=True) if "haproxy" in p.name()]
            assert haproxy and f":{port}" in (haproxy[0].cwd() + open_config(haproxy[0]))
            assert len(c.rollouts(GREEDY).groups[0].samples) == 1
            model = AutoModelForCausalLM.from_pretrained(tiny_model)
            assert (
                push_weights(WeightPusher(c, "full"), model)
                == 1
                == c.rollouts(GREEDY).groups[0].samples[0].weight_version
            )
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out[-3000:]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in haproxy)


def open_config(process) -> str:
    """The text of the config file an haproxy process was started with (-f FILE)."""
    args = process.cmdline()
    return open(args[args.index("-f") + 1]).read() if "-f" in args else ""


def serve_fails(tmp_path, **env) -> str:
    """`farm serve` with these FARM_* variables (and no FARM_API_TOKEN unless given): it must exit at once with a
    message, before starting Ray; returns the message."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_farm.trainer.cli", "serve"],
        env={**base, "FARM_STATE_DIR": str(tmp_path / "state"), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_serve_errors_name_the_variable_and_the_fix(tiny_model, tmp_path):
    no_token = serve_fails(tmp_path, FARM_MODEL=str(tiny_model))
    assert "FARM_API_TOKEN is not set" in no_token and "secrets.token_urlsafe(32)" in no_token
    assert "Field required" not in no_token  # no pydantic dump
    short = serve_fails(tmp_path, FARM_MODEL=str(tiny_model), FARM_API_TOKEN="s3cr3t", FARM_PORT="eighty")
    assert "FARM_API_TOKEN: Value should have at least 8" in short
    assert "s3cr3t" not in short  # a secret is never echoed
    assert "FARM_PORT='eighty': Input should be a valid integer" in short
    missing = serve_fails(tmp_path, FARM_MODEL=str(tmp_path / "nowhere"), FARM_API_TOKEN=TOKEN)
    assert "FARM_MODEL=" in missing and "no model folder" in missing
    engine = serve_fails(tmp_path, FARM_MODEL=str(tiny_model), FARM_API_TOKEN=TOKEN, FARM_ENGINE="vllm")
    assert "FARM_ENGINE" in engine and "valid names" in engine


def farm(*args: str, service: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FARM_API_TOKEN": TOKEN, "FARM_URL": service}
    return subprocess.run(
        [sys.executable, "-m", "rollout_farm.trainer.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_rollout_weights_and_control(service, client, fresh_weights, tiny_model):
    out = farm(
        "rollout",
        "--prompt",
        "Q: 1+2\nA:",
        "--ground-truth",
        "3",
        "--n",
        "2",
        "--max-new-tokens",
        "5",
        "--reward",
        "gsm8k",
        service=service,
    )
    assert out.returncode == 0, out.stderr
    groups = json.loads(out.stdout)["groups"]
    assert len(groups) == 1 and len(groups[0]["samples"]) == 2
    out = farm("weights", "push", str(tiny_model / "model.safetensors"), service=service)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["version"] == fresh_weights + 1 == client.weights_version().version
    assert json.loads(farm("weights", "version", service=service).stdout)["version"] == fresh_weights + 1
    bad = farm("weights", "push", str(tiny_model / "config.json"), service=service)  # not safetensors
    assert bad.returncode == 1 and "safetensors" in bad.stderr
    assert all(not r["paused"] for r in json.loads(farm("control", "resume", service=service).stdout)["replicas"])
