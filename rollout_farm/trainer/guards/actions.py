"""What the trainer does when a guard trips (rollout_farm/trainer/guards/checks.py decides): raise the mini-batch
size, or roll back to the last good step (or the last checkpoint). Each action is logged as a guard_action event."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rollout_farm.trainer.guards import last_good
from rollout_farm.trainer.outputs import checkpoint

if TYPE_CHECKING:
    from rollout_farm.trainer.run import TrainingRun

log = logging.getLogger("farm.trainer")


def carry_out(run: TrainingRun, action: str) -> None:
    if action == "raise_mini_batch":
        raise_mini_batch(run)
    elif action == "lower_mini_batch":
        lower_mini_batch(run)
    elif action == "rollback":
        rollback(run)


def raise_mini_batch(run: TrainingRun) -> None:
    """Bigger mini-batches from now on: they average the noisier gradient."""
    was, run.mini_batch_size = run.mini_batch_size, run.cfg.guards.raised_mini_batch_size
    log.warning(
        "guard_action", extra={"action": "raise_mini_batch", "step": run.step, "from": was, "to": run.mini_batch_size}
    )


def lower_mini_batch(run: TrainingRun) -> None:
    """Back to ppo_mini_batch_size once the variance statistic has stayed low (guards.variance_lower, lower_after)."""
    was, run.mini_batch_size = run.mini_batch_size, run.cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    log.warning(
        "guard_action", extra={"action": "lower_mini_batch", "step": run.step, "from": was, "to": run.mini_batch_size}
    )


def rollback(run: TrainingRun) -> None:
    """Restore the last good step (rollout_farm/trainer/guards/last_good.py) or, with guards.rollback_to=checkpoint,
    the last checkpoint (not its RNG states: the same draws could lead to the same blow-up). The loop checks the
    guards before it pushes, so the rolled-back policy never reached the service: the last good step is what it
    serves already, and nothing is pushed. A checkpoint may be older than that: sampling is paused, its weights are
    pushed as a new version, and sampling resumes."""
    good = run.last_good if last_good.wanted(run) else None
    ckpt = checkpoint.latest(run.out) if good is None and run.out else None
    if good is None and ckpt is None:
        raise RuntimeError("KL guard: no checkpoint to roll back to; set trainer.default_local_dir")
    bad_step, generated = run.step, run.generated_tokens
    if good is not None:
        last_good.restore(run, good)
    else:
        restore_checkpoint(run, ckpt)
    run.generated_tokens = generated  # work done is done: the counter does not roll back
    log.warning(
        "guard_action",
        extra={
            "action": "rollback",
            "step": bad_step,
            "to_step": run.step,
            "from": "last_good" if good is not None else "checkpoint",
            "version": run.version,
        },
    )


def restore_checkpoint(run: TrainingRun, ckpt) -> None:
    """Load `ckpt` without its RNG states and serve it: pause sampling, push its weights, resume."""
    if run.rank == 0:
        run.client.control("pause")
    try:
        run.restore(ckpt, rngs=False)
        run.push()
    finally:
        if run.rank == 0:
            run.client.control("resume")
