"""Every trainer metric (farm_trainer_*) the Grafana dashboard and the alert rules query exists in a real
`farm train` process's Prometheus endpoint (trainer.metrics_port), scraped over HTTP while it trains against the
session's service, after its first step. The service's names: tests/service/test_monitoring_metrics.py."""

import os
import subprocess
import time

import httpx

from rollout_farm.services.net import free_port
from tests.conftest import TOKEN
from tests.deploy.monitoring import missing, queried
from tests.e2e.commands import farm_train
from tests.metrics_text import samples, value


def step_of(text: str) -> float:
    return next((v for _, v in samples(text, "farm_trainer_step")), 0.0)


def scrape_after_first_step(url: str, proc: subprocess.Popen, log) -> str:
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            text = httpx.get(url, timeout=10).text
            if step_of(text) >= 1:
                return text
        except httpx.TransportError:  # not serving yet
            pass
        time.sleep(0.5)


def test_every_trainer_metric_the_dashboard_and_alerts_query_is_served_by_farm_train(service, tiny_model, tmp_path):
    port = free_port()
    cmd = farm_train(
        service,
        tiny_model,
        *"--task arith --steps 50 --train-batch-size 2 --n 2 --ppo-mini-batch-size 2 --lr 0.01 --out".split(),
        str(tmp_path),
        f"trainer.metrics_port={port}",
    )  # more steps than it needs: it is stopped once scraped
    log = tmp_path / "train.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, "FARM_API_TOKEN": TOKEN}, stdout=out, stderr=subprocess.STDOUT)
    try:
        text = scrape_after_first_step(f"http://127.0.0.1:{port}/metrics", proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    names = queried(trainer=True)
    assert {"farm_trainer_reward_mean", "farm_trainer_step_seconds", "farm_trainer_guard_actions_total"} <= set(names)
    assert {n: sorted(names[n]) for n in missing(names, text)} == {}
    assert missing({"farm_trainer_stepp"}, text) == {"farm_trainer_stepp"}  # the check can fail
    for action in ("rollback", "raise_mini_batch"):  # no guard acted (guards are off): exported at 0 all the same
        assert f'farm_trainer_guard_actions_total{{action="{action}"}} 0.0' in text
    assert value(text, "farm_trainer_step_seconds") > 0
