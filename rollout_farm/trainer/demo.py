"""`farm demo`: the whole loop on one machine, as three OS processes.

this process ── starts ──► `farm serve` (Ray Serve app on 127.0.0.1; its log: OUT/service.log)
             └─ starts ──► `farm train` (talks to the service over HTTP only; its JSON log: OUT/train.log)
and prints held-out accuracy before and after, with 95% intervals. The console shows the trainer's progress bar, a
short line every 10 steps, and warnings and errors; FARM_LOG_LEVEL=debug adds the trainer's JSON lines.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rollout_farm.services.client import FarmClient
from rollout_farm.services.models import resolve_model
from rollout_farm.services.net import free_port
from rollout_farm.trainer.evaluate import paired_gain

DEMO_STEPS = 80
DEMO_EVAL_SIZE = 1000  # capped by the task's held-out split
# The demo's settings over the trainer's defaults. At lr 5e-5 the embedded model learns the rewarded format and
# loses sums (0.536 -> 0.363 right in any format); at 2e-5 it learns the format and keeps them (README).
DEMO_SETTINGS = ["actor_rollout_ref.actor.optim.lr=2e-5"]


def run_demo(model: str, steps: int | None, eval_size: int | None, out: str) -> int:
    start = time.time()
    steps, eval_size = steps or DEMO_STEPS, eval_size or DEMO_EVAL_SIZE
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    train_log = out_dir / "train.log"
    train_log.unlink(missing_ok=True)
    state = out_dir / "state"  # the service's embedded Redis: a demo starts from version 0 and an empty queue
    shutil.rmtree(state, ignore_errors=True)
    path = resolve_model(model)  # builds the embedded default on first run
    token, port = secrets.token_urlsafe(24), free_port()
    env = {
        **os.environ,
        "FARM_API_TOKEN": token,
        "FARM_PORT": str(port),
        "FARM_MODEL": str(path),
        "FARM_STATE_DIR": str(state),
    }
    env.pop("FARM_REDIS_URL", None)
    farm = [sys.executable, "-m", "rollout_farm.trainer.cli"]
    with (out_dir / "service.log").open("w") as service_log:
        service = subprocess.Popen(farm + ["serve"], env=env, stdout=service_log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            print(f"starting the rollout service on {url} (log: {out_dir / 'service.log'})", flush=True)
            with FarmClient(url) as client:
                client.wait_ready(timeout_s=300)
            train = farm + [
                "train",
                "--service-url",
                url,
                "--model",
                str(path),
                "--steps",
                str(steps),
                "--eval-size",
                str(eval_size),
                "--out",
                str(out_dir),
                "--log-file",
                str(train_log),
                "trainer.resume_mode=disable",  # a demo starts from the model, not from the last run
                *DEMO_SETTINGS,
            ]
            print(
                f"scoring the held-out problems, then training {steps} steps "
                f"(log: {train_log}, metrics: {out_dir / 'metrics.jsonl'})",
                flush=True,
            )
            code = subprocess.run(train, env=env).returncode
        finally:
            service.send_signal(signal.SIGTERM)
            try:
                service.wait(timeout=60)
            except subprocess.TimeoutExpired:
                service.kill()
    if code:
        print(f"training failed (exit status {code}); see above, and {train_log}", file=sys.stderr)
        return code
    summary = json.loads((out_dir / "summary.json").read_text())
    report(summary, time.time() - start)
    return 0


def fmt(accuracy: dict, key: str = "") -> str:
    """An accuracy and its 95% interval from an evaluation's dict; key "number_" for the any-format figure."""
    lo, hi = accuracy[key + "ci95"]
    return f"{accuracy[key + 'accuracy']:.3f}  (95% CI {lo:.3f}-{hi:.3f})"


def report(summary: dict, wall_s: float) -> None:
    before, after = summary["before"], summary["after"]
    gain, half = paired_gain(before["correct"], after["correct"])
    print(f"\nheld-out accuracy on {before['n']} problems never seen in pretraining or RL (greedy):")
    print(f"  before RL : {fmt(before)}")
    print(f"  after RL  : {fmt(after)}   weight version {summary['final_weight_version']}")
    verdict = "beyond noise" if gain - half > 0 else "NOT beyond noise"
    print(f"  gain      : {gain:+.3f} ± {half:.3f} (paired 95% CI) -> {verdict}")
    if "number_correct" in before:
        change, half = paired_gain(before["number_correct"], after["number_correct"])
        held = "rises" if change - half > 0 else "falls" if change + half < 0 else "holds (within noise)"
        print("  right number in any format (not rewarded):")
        print(f"    before  : {fmt(before, 'number_')}")
        print(f"    after   : {fmt(after, 'number_')}")
        print(f"    change  : {change:+.3f} ± {half:.3f} (paired 95% CI) -> {held}")
    print(f"  wall time : {wall_s:.0f} s")
