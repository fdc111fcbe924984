"""Guards: watch each step's KL to the reference and a variance statistic, and say what to do when a threshold is
crossed. Off unless `guards.enable` (the design preset turns them on, with its adaptive KL controller aiming at 0.01).

    KL > kl_rollback (0.05)               rollback: pause sampling, restore the last good step (rollback_to;
                                          rollout_farm/trainer/guards/last_good.py), push its weights as a new
                                          version, resume
    variance statistic > variance_raise   raise ppo_mini_batch_size to raised_mini_batch_size (both in groups,
      (0.3)                               as verl counts them): fewer, bigger mini-batches, so fewer optimizer
                                          steps per epoch, each averaging the noisier gradient over more samples
    ... below variance_lower, lower_after  lower it back to ppo_mini_batch_size (hysteresis: variance_lower is
      steps in a row                      below variance_raise, half of it by default)
The KL is the exact one (rollout_farm/trainer/algorithms/forward.py). The variance statistic (`variance_statistic`)
is the batch's reward std (the default: on 0/1 rewards it passes 0.3 whenever the mean reward is between 0.1 and 0.9),
reward variance (at most 0.25 on 0/1 rewards, so 0.3 never trips it there), advantage variance, or the gradient noise
scale (rollout_farm/trainer/algorithms/noise_scale.py) divided by the mini-batch's samples: above 1 the mini-batch is
below the critical batch size, so variance_raise=1 raises it exactly when a bigger one pays (measured only when
chosen: it compares each micro-batch's gradient with the mini-batch's, so it needs ppo_micro_batch_size_per_gpu below
a mini-batch).
The targets (KL < 0.02, reward std < 0.2) are only reported: `guard_kl_over_target`, `guard_reward_std_over_target`.
The trainer carries the actions out (rollout_farm/trainer/guards/actions.py); each is logged (event guard_action) and
counted (farm_trainer_guard_actions_total{action}).
"""

from __future__ import annotations

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
        "with the variance statistic below this (hysteresis: below variance_raise); None: half of variance_raise",
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


class Guard:
    def __init__(self, cfg: GuardConfig, base_mini_batch_size: int | None = None):
        """`base_mini_batch_size`: ppo_mini_batch_size, what a raised size is lowered back to (None: never)."""
        self.cfg, self.base = cfg, base_mini_batch_size
        self.rollbacks_in_a_row = 0
        self.calm_steps = 0  # steps in a row with the variance statistic below variance_lower

    @property
    def lower_below(self) -> float:
        c = self.cfg
        return c.variance_lower if c.variance_lower is not None else c.variance_raise / 2

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
