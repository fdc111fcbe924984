"""A step's metrics: one JSON line of metrics.jsonl, the same as a log event, and Prometheus gauges."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from prometheus_client import Gauge, start_http_server

from trainer.batch import Batch

log = logging.getLogger("farm.trainer")
GAUGE_HELP = {
    "step": "Last finished training step",
    "kl_ref": "KL of the policy to the reference, last step",
    "reward_mean": "Batch reward mean, last step",
    "reward_std": "Batch reward std, last step",
    "kl_coef": "KL coefficient (the controller's value)",
    "adv_var": "Variance of the advantages, last step",
    "weight_version": "Last pushed weight version",
    "step_seconds": "Seconds the last step took (rollouts to update)",
    "tokens_per_s": "Response tokens per second of the last step",
}
STEP_GAUGES = {key: Gauge(f"farm_trainer_{key}", help) for key, help in GAUGE_HELP.items()}


def serve(port: int) -> None:
    """The trainer's Prometheus metrics (these gauges, the guard actions) on http://0.0.0.0:port/metrics."""
    start_http_server(port)


def batch_metrics(b: Batch, seconds: float) -> dict:
    tokens = int(b.response_mask.sum())
    return {
        "reward_mean": b.rewards.mean().item(),
        "reward_std": b.rewards.std(unbiased=False).item(),
        "response_len": tokens / len(b),
        "step_seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "samples": len(b),
    }


def record(out: Path | None, metrics: dict) -> None:
    """Log the step, append it to out/metrics.jsonl and set the gauges."""
    rounded = {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in metrics.items()}  # 6 significant digits
    log.info("train_step", extra=rounded)
    if out:
        with (out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"event": "train_step", **rounded}) + "\n")
    for key, gauge in STEP_GAUGES.items():
        gauge.set(metrics.get(key, 0.0))
