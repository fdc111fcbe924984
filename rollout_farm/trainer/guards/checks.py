"""Guards: watch each step's KL to the reference and a variance statistic, and say what to do when a threshold is
crossed. Off unless `guards.enable` (the design preset turns them on, with its adaptive KL controller aiming at 0.01).

    KL > kl_rollback (0.05)               rollback: pause sampling, restore the last good step (rollback_to;
                                          rollout_farm/trainer/guards/last_good.py), push its weights as a new
                                          version, resume
    variance statistic > variance_raise   raise ppo_mini_batch_size to raised_mini_batch_size (both in groups,
      (0.3)                               as verl counts them): fewer, bigger mini-batches, so fewer optimizer
                                          steps per epoch, each averaging the noisier gradient over more samples
    ... below variance_lower, lower_after  lower it back to ppo_mini_batch_size (hysteresis: variance_lower is
      steps in a row                      below variance_raise; by default see `default_lower`)
The KL is the exact one (rollout_farm/trainer/algorithms/forward.py). The variance statistic (`variance_statistic`)
is the batch's reward std (the default: on 0/1 rewards it passes 0.3 whenever the mean reward is between 0.1 and 0.9),
reward variance (at most 0.25 on 0/1 rewards, so 0.3 never trips it there), advantage variance, or the gradient noise
scale (rollout_farm/trainer/algorithms/noise_scale.py) divided by the mini-batch's samples: above 1 the mini-batch is
below the critical batch size, so variance_raise=1 raises it exactly when a bigger one pays (measured only when
chosen: it compares each micro-batch's gradient with the mini-batch's, so it needs ppo_micro_batch_size_per_gpu below
a mini-batch).
On 0/1 rewards the reward std is sqrt(p(1-p)) of the mean reward p, so a bound on it is a bound on p: 0.3 raises
for p in (0.1, 0.9), and half of it, 0.15, would lower only below p 0.023 (or above 0.977), which a run that learns
rarely reaches. So by default the reward std's (and variance's) lower bound halves the bound in p, not in std:
0.3 -> p 0.1 -> p 0.05 -> std 0.218 (`default_lower`); the other statistics' is half of variance_raise.
The targets (KL < 0.02, reward std < 0.2) are only reported: `guard_kl_over_target`, `guard_reward_std_over_target`.
The trainer carries the actions out (rollout_farm/trainer/guards/actions.py); each is logged (event guard_action) and
counted (farm_trainer_guard_actions_total{action}).
"""

from __future__ import annotations

import math
from typing import Literal

from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, model_validator

GUARD_ACTIONS = ("rollback", "raise_mini_batch", "lower_mini_batch")  # what Guard.check may ask for
ACTIONS = Counter("farm_trainer_guard_actions_total", "Guard actions the trainer took", ["action"])
for _action in GUARD_ACTIONS:  # exported at 0 from the start, so increase() sees the first one
    ACTIONS.labels(_action)


class GuardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enable: bool = Field(
        False,
        description="off by default: without a KL penalty the KL to the reference grows by design "
        "(farm demo passes 0.1)",
    )
    kl_target: float = Field(0.02, gt=0, description="reported as over target above this")
    kl_rollback: float = Field(0.05, gt=0, description="roll back above this (to what rollback_to says)")
    rollback_to: Literal["last_good", "checkpoint"] = Field(
        "last_good",
        description="last_good: the last step the guards did not roll back, kept in CPU memory (about three times "
        "the policy's size with AdamW); checkpoint: the last checkpoint (with save_freq=-1, step 0)",
    )
    reward_std_target: float = Field(0.2, gt=0)
    variance_statistic: Literal["reward_std", "reward_var", "adv_var", "grad_noise_scale"] = Field(
        "reward_std",
        description="what variance_raise is compared with; grad_noise_scale is the noise scale over the "
        "mini-batch's samples (set variance_raise to 1 for it) and needs micro-batches",
    )
    variance_raise: float = Field(0.3, gt=0, description="raise the mini-batch size above this variance statistic")
    raised_mini_batch_size: int = Field(
        16, ge=1, description="in groups, like ppo_mini_batch_size (16 groups of 8 samples: 128 samples)"
    )
    variance_lower: float | None = Field(
        None,
        gt=0,
        description="once raised, lower the mini-batch back to ppo_mini_batch_size after lower_after steps in a row "
        "with the variance statistic below this (hysteresis: below variance_raise); None: for reward_std and "
        "reward_var, the value at half the mean reward p at which 0/1 rewards reach variance_raise (0.3 -> p 0.1 -> "
        "p 0.05 -> std 0.218; half of the std itself, 0.15, needs p below 0.023); for the others half of "
        "variance_raise",
    )
    lower_after: int = Field(3, ge=1, description="steps in a row below variance_lower before the size is lowered")

    @model_validator(mode="after")
    def _hysteresis(self) -> "GuardConfig":
        if self.variance_lower is not None and self.variance_lower >= self.variance_raise:
            raise ValueError(
                f"guards.variance_lower: {self.variance_lower} is not below variance_raise={self.variance_raise}, so "
                "the size would go up and down on the same readings: set it lower (or leave it out: half of it)"
            )
        return self

    max_rollbacks: int = Field(
        3, ge=0, description="stop with an error after this many rollbacks in a row without progress"
    )


def default_lower(statistic: str, raise_at: float) -> float:
    """guards.variance_lower's default. The reward std and variance of 0/1 rewards with mean p are sqrt(p(1-p)) and
    p(1-p): the bound is halved in p (the p below 1/2 at which they reach `raise_at`, halved, read back as a std or a
    variance), so a run whose reward leaves the noisy middle gets its size back. Half of `raise_at` otherwise, and
    where 0/1 rewards never reach it (a variance above 0.25, a std above 0.5)."""
    var = {"reward_std": raise_at**2, "reward_var": raise_at}.get(statistic)
    if var is None or var >= 0.25:
        return raise_at / 2
    p = (1 - math.sqrt(1 - 4 * var)) / 2 / 2
    return math.sqrt(p * (1 - p)) if statistic == "reward_std" else p * (1 - p)


class Guard:
    def __init__(self, cfg: GuardConfig, base_mini_batch_size: int | None = None):
        """`base_mini_batch_size`: ppo_mini_batch_size, what a raised size is lowered back to (None: never)."""
        self.cfg, self.base = cfg, base_mini_batch_size
        self.rollbacks_in_a_row = 0
        self.calm_steps = 0  # steps in a row with the variance statistic below variance_lower

    @property
    def lower_below(self) -> float:
        c = self.cfg
        return (
            c.variance_lower if c.variance_lower is not None else default_lower(c.variance_statistic, c.variance_raise)
        )

    def check(self, kl: float, stats: dict[str, float], mini_batch_size: int) -> tuple[list[str], dict]:
        """The actions for this step's KL and variance statistics (reward_std, reward_var, adv_var and, when
        measured, grad_noise_scale), and flags to log."""
        c = self.cfg
        variance = stats[c.variance_statistic]
        flags = {
            "guard_variance": variance,  # the statistic variance_raise is compared with
            "guard_kl_over_target": kl > c.kl_target,
            "guard_reward_std_over_target": stats["reward_std"] > c.reward_std_target,
        }
        if not c.enable:
            return [], flags
        actions = []
        if kl > c.kl_rollback:
            self.rollbacks_in_a_row += 1
            if self.rollbacks_in_a_row > c.max_rollbacks:
                raise RuntimeError(
                    f"KL stayed above {c.kl_rollback} after {c.max_rollbacks} rollbacks: "
                    "lower the learning rate or raise kl_coef"
                )
            actions.append("rollback")
        else:
            self.rollbacks_in_a_row = 0
        if variance > c.variance_raise and mini_batch_size < c.raised_mini_batch_size:
            actions.append("raise_mini_batch")
        self.calm_steps = self.calm_steps + 1 if variance < self.lower_below else 0
        if self.base is not None and mini_batch_size > self.base and self.calm_steps >= c.lower_after:
            actions.append("lower_mini_batch")
            self.calm_steps = 0
        for a in actions:
            ACTIONS.labels(a).inc()
        return actions, flags
