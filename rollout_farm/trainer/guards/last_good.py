"""The last good step, kept in memory: what a KL rollback returns to (rollout_farm/trainer/guards/actions.py).

A step is good when the guards did not roll it back. After each good step its policy, critic and optimizer states
are copied to the CPU, so a rollback undoes the bad step, not the run: the periodic checkpoints may be far behind,
and with trainer.save_freq=-1 (the default) the only one is step 0. The copies cost about three times the policy's
size in CPU memory with AdamW; guards.rollback_to=checkpoint goes back to the last checkpoint instead, without them.
Only kept when the guards are on (nothing else rolls back)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout_farm.services.weights.state_dict import canonical_state_dict

if TYPE_CHECKING:
    from rollout_farm.trainer.run import TrainingRun


@dataclass
class LastGood:
    step: int
    policy: dict[str, torch.Tensor]
    critic: dict[str, torch.Tensor] | None
    optimizers: dict[str, dict]
    kl_coef: float
    mini_batch_size: int


def wanted(run: TrainingRun) -> bool:
    g = run.cfg.guards
    return g.enable and g.rollback_to == "last_good"


def _on_cpu(obj):
    """A copy of an optimizer's state dict with its tensors on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_on_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in canonical_state_dict(model).items()}


def keep(run: TrainingRun) -> LastGood:
    """This step's state, copied."""
    return LastGood(
        step=run.step,
        policy=_weights(run.policy),
        critic=_weights(run.critic) if run.critic is not None else None,
        optimizers={name: _on_cpu(opt.state_dict()) for name, opt in run.opt.items()},
        kl_coef=run.kl_ctrl.value,
        mini_batch_size=run.mini_batch_size,
    )


def restore(run: TrainingRun, good: LastGood) -> None:
    """Put the kept step back into the run (the copy stays intact: a second rollback can return to it again)."""
    with torch.no_grad():
        for model, kept in ((run.policy, good.policy), (run.critic, good.critic)):
            if model is not None and kept is not None:
                params = canonical_state_dict(model)
                for name, t in kept.items():
                    params[name].copy_(t)
    for name, opt in run.opt.items():
        opt.load_state_dict(_on_cpu(good.optimizers[name]))  # a copy: load_state_dict may keep what it is given
    run.step, run.kl_ctrl.value, run.mini_batch_size = good.step, good.kl_coef, good.mini_batch_size
