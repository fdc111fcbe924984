"""The guards' wiring in the real loop (rollout_farm/trainer/loop.py `train`): which KL the guards read, which KL the
samplers get, which policies are pushed and evaluated, and the last good step the loop keeps.

The run is a small torch model with a real AdamW, verl's KL controller and the real Guard; the phases that need a
model or a service are stubs: `rollouts.pull` returns one fixed batch, `train_step` takes an optimizer step and
returns scripted KL readings (each reading a different number, so a mix-up shows), the client records what the
samplers are told, `push` and `held_out_accuracy` record the weights they see. Steps 2 and 4 pass kl_rollback.

Mutations, each seen failing here (applied to loop.py, run, reverted):
- the guards read `metrics["kl_ref_before"]` (the KL of the policy that sampled) instead of `kl_ref`;
- the samplers get `metrics["kl_ref_sampled"]` (or `kl_ref_before`) instead of `kl_ref`;
- the push moved back before the guards (`if kept:` dropped before `timed(run.push)`): a rolled-back policy served;
- `report` without its `kept` test: the rolled-back policy scored and its KL sent to the samplers;
- the loop's `run.last_good = last_good.keep(run)` after a kept step deleted: the rollback at step 4 returns to the
  run's start, not to step 3.
"""

import pytest
import torch

from rollout_farm.services import protocol as P
from rollout_farm.trainer import loop
from rollout_farm.trainer.batch import make_batch
from rollout_farm.trainer.config import load
from rollout_farm.trainer.guards.checks import Guard
from rollout_farm.trainer.sync import rollouts
from tests.unit.fake_run import fake_run

# step -> the updated policy's KL (what the guards and the samplers must read); kl_rollback is 0.05
KL_AFTER = {1: 0.010, 2: 0.090, 3: 0.020, 4: 0.080}
KL_BEFORE, KL_SAMPLED = 0.001, 0.004  # the sampling policy's, and the updated one's at the samples' temperature


class Client:
    def __init__(self):
        self.kls, self.calls = [], []

    def report_policy_stats(self, stats: P.PolicyStats):
        self.kls.append(stats.kl)

    def control(self, verb):
        self.calls.append(verb)


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def make_run():
    cfg = load(
        None,
        [
            "guards.enable=true",
            "guards.variance_raise=10",  # this test is about the KL guard
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.total_training_steps=4",
            "trainer.eval_size=4",
            "trainer.test_freq=1",
        ],
    )
    run = fake_run(
        cfg,
        Client(),
        guard=Guard(cfg.guards, 8),
        world=1,
        device="cpu",
        leased=[],
        pull_stats={},
        redelivered=0,
        pushed=[],  # (step, weights) of every push
        evaluated=[],  # (step, weights) of every held-out scoring
        kept=[],  # run.last_good.step after each step, as the loop left it
    )
    policy = run.policy

    def push():
        run.version += 1
        run.pushed.append((run.step, weights(policy)))

    run.push = push
    return run


def one_batch():
    samples = [
        P.Sample(token_ids=[5, 6], logprobs=[-1.0, -1.0], text="x", finish_reason="length", weight_version=0, reward=r)
        for r in (0.0, 1.0)
    ]
    group = P.Group(prompt_token_ids=[1, 2], samples=samples, reward_mean=0.5, reward_std=0.5, zero_variance=False)
    return make_batch([group], pad_id=0)


def fake_train_step(run, step: int) -> dict:
    """An optimizer step on the policy (so every step's weights differ) and step `step`'s scripted readings; notes
    the last good step the loop left for it."""
    if run.last_good is not None:
        run.kept.append(run.last_good.step)
    loss = run.policy(torch.randn(5, 4)).pow(2).sum()
    loss.backward()
    run.opt["actor"].step()
    run.opt["actor"].zero_grad()
    return {"kl_ref_before": KL_BEFORE, "kl_ref": KL_AFTER[step], "kl_ref_sampled": KL_SAMPLED, "adv_var": 0.1}


@pytest.fixture
def trained(monkeypatch):
    """The run after loop.train over the 4 steps, and its starting weights."""
    run = make_run()
    steps = iter(KL_AFTER)

    def held_out(r):
        r.evaluated.append((r.step, weights(r.policy)))
        return {"accuracy": 0.5}

    monkeypatch.setattr(rollouts, "pull", lambda r: one_batch())
    monkeypatch.setattr(loop, "train_step", lambda r, b: fake_train_step(r, next(steps)))
    monkeypatch.setattr(loop, "held_out_accuracy", held_out)
    start = weights(run.policy)
    loop.train(run)
    return run, start


def test_the_guards_read_the_updated_kl_and_the_samplers_get_it_only_from_kept_steps(trained):
    run, _ = trained
    # the rollbacks at steps 2 and 4 happened: the guards read kl_ref (kl_ref_before and kl_ref_sampled never pass)
    assert run.guard.rollbacks_in_a_row == 1 and run.step == 3
    # the samplers got the kept steps' updated KL, never a rolled-back one's
    assert run.client.kls == [KL_AFTER[1], KL_AFTER[3]]


def test_only_the_kept_policies_are_pushed_and_evaluated(trained):
    run, start = trained
    assert [s for s, _ in run.pushed] == [1, 3] and run.version == 2
    assert [s for s, _ in run.evaluated] == [0, 1, 3, 3]  # before, steps 1 and 3, after (the restored step 3)
    assert run.client.calls == []  # the service never served the bad policy: no pause, no push on rollback
    for (_, pushed), (_, scored) in zip(run.pushed, run.evaluated[1:3]):
        assert same(pushed, scored) and not same(pushed, start)


def test_the_loop_refreshes_the_last_good_step_after_each_kept_step(trained):
    run, _ = trained
    # what each step started from: the run's start, step 1, step 1 again (2 was rolled back), step 3
    assert run.kept == [0, 1, 1, 3]
    assert run.last_good.step == 3 and same(run.pushed[-1][1], weights(run.policy))  # step 4 undone: back at 3
