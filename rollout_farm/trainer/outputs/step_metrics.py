"""A step's metrics: one JSON line of metrics.jsonl, the same as a log event, and Prometheus gauges."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from prometheus_client import Gauge, Histogram, start_http_server

from rollout_farm.trainer.batch import Batch

log = logging.getLogger("farm.trainer")
GAUGE_HELP = {
    "step": "Last finished training step",
    "kl_ref": "KL of the policy to the reference at algorithm.kl_temperature (what the guards read), last step",
    "kl_ref_sampled": "KL of the policy to the reference at each sample's own temperature, last step",
    "reward_mean": "Batch reward mean, last step",
    "reward_std": "Batch reward std, last step",
    "kl_coef": "KL coefficient (the controller's value)",
    "adv_var": "Variance of the advantages, last step",
    "weight_version": "Last pushed weight version",
    "step_seconds": "Seconds the last step took (rollouts to update)",
    "tokens_per_s": "Response tokens per second of the last step",
}
# set only by the steps that have them (the queue's, and the staleness of the samples); NaN when a step has none
ASYNC_GAUGE_HELP = {
    "trainer_idle_ratio": "Share of the last step spent waiting for rollouts",
    "rollout_idle_ratio": "Share of the last step cycle the service's generation loop for the trainer's queue "
    "source had nothing it was allowed to generate",
    "staleness_mean": "Mean staleness of the last step's samples: trainer version minus the oldest token's version",
    "staleness_max": "Largest staleness among the last step's samples",
    "spanning_samples": "Samples of the last step whose tokens come from more than one weight version",
    "offpolicy_fraction": "Share of the last step's samples with staleness above 0",
    "offpolicy_is_weight_mean": "Mean importance weight applied to the tokens of the last step's stale samples",
    "offpolicy_clipped_fraction": "Share of the stale samples' tokens whose importance weight was capped",
    "offpolicy_masked_fraction": "Share of the stale samples' tokens given weight 0 (masked IS or rejection)",
    "stale_dropped_groups": "Groups the queue dropped as too stale while the last step pulled",
    "refused_groups": "Groups the trainer refused as too stale itself while the last step pulled",
}
STEP_GAUGES = {key: Gauge(f"farm_trainer_{key}", help) for key, help in (GAUGE_HELP | ASYNC_GAUGE_HELP).items()}
STALENESS = Histogram(
    "farm_trainer_sample_staleness_versions",
    "Staleness of each sample trained on: the trainer's version minus the sample's oldest token version",
    buckets=(0, 1, 2, 3, 4, 8, 16),
)


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


def pull_metrics(pulled: dict, seconds: float) -> dict:
    """The pull's figures (rollout_farm/trainer/sync/rollouts.py: rollout_wait_s, the queue's drops and
    rollout_idle_ratio) and trainer_idle_ratio: the share of the step spent waiting for them."""
    wait = pulled.get("rollout_wait_s", 0.0)
    return pulled | {"trainer_idle_ratio": wait / seconds if seconds > 0 else 0.0}


def record(out: Path | None, metrics: dict) -> None:
    """Log the step, append it to out/metrics.jsonl and set the gauges."""
    rounded = {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in metrics.items()}  # 6 significant digits
    log.info("train_step", extra=rounded)
    if out:
        with (out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"event": "train_step", **rounded}) + "\n")
    for key, gauge in STEP_GAUGES.items():
        if key in GAUGE_HELP:
            gauge.set(metrics.get(key, 0.0))
        elif key in metrics:
            gauge.set(math.nan if metrics[key] is None else metrics[key])
    for lag, count in enumerate(metrics.get("staleness_hist", [])):
        for _ in range(count):
            STALENESS.observe(lag)
