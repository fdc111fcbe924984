"""The `farm` entry points as real processes: `farm serve`, `farm train`, and the CLI against a service."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
from transformers import AutoModelForCausalLM

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from rollout_farm.services.serving.haproxy_orphans import node_haproxies
from rollout_farm.services.weights.pusher import WeightPusher
from rollout_farm.trainer.sync.weights import push_weights
from tests.conftest import TOKEN
from tests.e2e.commands import farm_serve, farm_train, serve_env, stop
from tests.haproxies import listening, stand_in

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
    """... and ends every haproxy of its Ray node, the one its HAProxy manager left too (when Serve's shutdown timed
    out, ray.shutdown() killed the manager before it ended its haproxy): a stand-in, started by this test with a
    config in the node's folder, must be gone after the stop."""
    env = serve_env(tiny_model, tmp_path)
    port = env["FARM_PORT"]
    proc = farm_serve(env)
    leftover = None
    try:
        url = f"http://127.0.0.1:{port}"
        with FarmClient(url, TOKEN) as c:
            c.wait_ready(timeout_s=180)
            (folder,) = {Path(config_path(p)).parent for p in haproxies(proc.pid)}  # the default front's HAProxy
            leftover, leftover_port = stand_in(folder / "left-behind.cfg")
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
        if leftover is not None:
            leftover_ended = leftover.poll() is not None
            leftover.kill()
            leftover.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "service_stopping" in out
    assert leftover_ended and not listening(leftover_port), "farm serve's stop left an haproxy of its node running"
    assert node_haproxies(folder.name) == []  # nor any other holding a port (services/serving/haproxy_orphans.py)


LONG = P.RolloutRequest(
    prompts=[P.Prompt(token_ids=[90, 91, 92])],
    n=1,
    sampling_params=P.SamplingParams(temperature=0, max_new_tokens=1000, ignore_eos=True),
)


def test_the_fused_front_behind_haproxy_serves_and_outlives_its_haproxy_killed(tiny_model, tmp_path):
    """FARM_FRONT=fused FARM_HTTP_PROXY=haproxy, the cheapest front (bench/README.md), as a process of its own:
    HAProxy answers on FARM_PORT (an haproxy process of this service's, its stats and metrics ports free ones, so it
    starts beside another service's, gone after the service stops); rollouts and a streamed weight upload pass through
    it. Then the haproxy process is killed while three rollouts with request ids are in flight (Serve's proxy actor
    health-checks it and starts another): each client's retries by request_id complete its rollout, once (a replay
    of the id gives the same samples)."""
    env = serve_env(tiny_model, tmp_path, replicas="2", front="fused", http_proxy="haproxy")
    port = env["FARM_PORT"]
    url = f"http://127.0.0.1:{port}"
    proc = farm_serve(env)
    try:
        with FarmClient(url, TOKEN) as c:
            c.wait_ready(timeout_s=180)
            haproxy = haproxies(proc.pid)
            assert haproxy and f":{port}" in (haproxy[0].cwd() + open_config(haproxy[0]))
            node = node_of(haproxy[0])
            assert len(c.rollouts(GREEDY).groups[0].samples) == 1
            model = AutoModelForCausalLM.from_pretrained(tiny_model)
            assert (
                push_weights(WeightPusher(c, "full"), model)
                == 1
                == c.rollouts(GREEDY).groups[0].samples[0].weight_version
            )
        results: dict = {}

        def send(k: int):
            # Serve's controller notices the dead haproxy at its proxy health checks and starts another (tens of
            # seconds): each retry waits up to 4 s, 150 of them about 5 minutes in all
            with FarmClient(url, TOKEN, retries=150, max_backoff_s=4.0) as client:
                results[k] = client.rollouts(LONG.model_copy(update={"request_id": f"haproxy-kill-{k}"}))

        senders = [threading.Thread(target=send, args=(k,)) for k in range(3)]
        for s in senders:
            s.start()
        deadline = time.monotonic() + 60  # the rollouts under way (1000 tokens each take seconds)
        while not any(r["busy"] for r in httpx.get(f"{url}/readyz", timeout=30).json().get("replicas", [])):
            assert time.monotonic() < deadline, "no replica took the rollouts"
            time.sleep(0.05)
        killed = haproxies(proc.pid)  # those running now (a reload of its config replaces the process)
        assert killed
        for p in killed:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        for s in senders:
            s.join(timeout=900)
        assert not any(s.is_alive() for s in senders) and sorted(results) == [0, 1, 2], results
        with FarmClient(url, TOKEN, retries=10) as c:
            for k, answer in results.items():
                (group,) = answer.groups
                assert len(group.samples) == 1 and len(group.samples[0].token_ids) == 1000
                again = c.rollouts(LONG.model_copy(update={"request_id": f"haproxy-kill-{k}"}))
                assert again.groups[0].samples[0].token_ids == group.samples[0].token_ids  # the id's one result
            haproxy = haproxies(proc.pid)  # the one Serve's proxy actor started after the kill
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out[-3000:]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in haproxy)
    assert node_haproxies(node) == []  # nor another of its node's


def haproxies(pid: int) -> list:
    """The haproxy processes under `pid` (one that ends while they are listed is left out)."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.name() == "haproxy":
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def config_path(process) -> str:
    """The config file an haproxy process was started with (-f FILE)."""
    args = process.cmdline()
    return args[args.index("-f") + 1] if "-f" in args else ""


def open_config(process) -> str:
    """The text of the config file an haproxy process was started with."""
    return open(path).read() if (path := config_path(process)) else ""


def node_of(process) -> str:
    """The Ray node an haproxy of Serve's serves: the folder of its config is named after it."""
    return Path(config_path(process)).parent.name


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
    engine = serve_fails(tmp_path, FARM_MODEL=str(tiny_model), FARM_API_TOKEN=TOKEN, FARM_ENGINE="tensorrt")
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
