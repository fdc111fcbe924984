"""seq-mean-token-sum-norm divides by a constant, as verl's does (verl pads every batch to the response limit):
the trainer passes `loss_scale_factor` (actor_rollout_ref.actor.loss_scale_factor, or the response length limit)
to verl's agg_loss through each mini-batch's share. Without it verl divides by the batch's padded width, which
here is the step's longest response, so the same samples weighed differently from step to step.

The negative control is the share without the factor: the same samples padded to two widths get two losses.
Mutations tried, each failing here: ppo_update not passing the factor to mini_batches; mini_batches dropping it."""

import types

import pytest
import torch

from rollout_farm.trainer import loop
from rollout_farm.trainer.algorithms import losses
from rollout_farm.trainer.batch import Batch
from rollout_farm.trainer.config import load
from rollout_farm.trainer.minibatches import mini_batches
from tests.unit.batches import response_batch

NORM = "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"


def padded(width: int) -> Batch:
    """Two groups of two samples, responses of 2-5 tokens, padded to `width`."""
    lengths = torch.tensor([5, 2, 3, 4])
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    return response_batch(
        mask, sampling_known=torch.zeros(len(lengths), dtype=torch.long), group_ids=torch.tensor([0, 0, 1, 1])
    )


def loss(width: int, factor: int | None) -> float:
    b = padded(width)
    share = next(mini_batches(b, size=2, loss_scale_factor=factor)).share
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=g)
    new = old + 0.1 * torch.randn(4, 5, generator=g)
    adv = torch.randn(4, 1, generator=g).expand(-1, 5)
    pad = width - 5
    old, new, adv = (torch.nn.functional.pad(x, (0, pad)) for x in (old, new, adv))
    value, _ = losses.ppo_loss(
        old, new, adv, b.response_mask, loss_agg_mode="seq-mean-token-sum-norm", global_batch=share
    )
    return value.item()


def test_the_same_samples_weigh_the_same_whatever_the_batch_is_padded_to():
    assert loss(5, 64) == pytest.approx(loss(9, 64), rel=1e-6)


def test_negative_control_without_the_factor_the_padded_width_divides():
    assert loss(5, None) == pytest.approx(loss(9, None) * 9 / 5, rel=1e-6)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([NORM, "data.max_response_length=64"], 64),
        ([NORM, "actor_rollout_ref.actor.loss_scale_factor=100"], 100),
        ([NORM], 48),
    ],
)
def test_the_trainer_passes_the_constant(monkeypatch, overrides, expected):
    cfg = load(None, overrides)
    seen = []
    run = types.SimpleNamespace(
        cfg=cfg,
        policy=torch.nn.Linear(1, 1),
        critic=None,
        opt={"actor": None},
        mini_batch_size=1,
        rank=0,
        world=1,
        task=types.SimpleNamespace(max_new_tokens=48),
    )
    monkeypatch.setattr(loop, "update_actor", lambda actor, opt, mb, noise: seen.append(mb.share) or {"pg_loss": 0.0})
    b = padded(7)
    loop.ppo_update(run, b, torch.zeros(4, 7), torch.zeros(4, 7), torch.zeros(4, 7), torch.ones(4, 7), None, None)
    assert seen and all(s["loss_scale_factor"] == expected for s in seen)
