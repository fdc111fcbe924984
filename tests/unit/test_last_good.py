"""rollout_farm/trainer/guards/last_good.py and the KL rollback (rollout_farm/trainer/guards/actions.py): a rollback
returns to the last step the guards did not roll back, not to the step-0 checkpoint that save_freq=-1 leaves; a
second rollback returns there again; rollback_to=checkpoint keeps the old behaviour (the negative control: it lands on
step 0).

The run is a small torch model with a real AdamW and verl's KL controller; its service client is a stub that
records the pause and the resume, and the push counts versions (the e2e test tests/e2e/test_trainer.py rolls back
against the service)."""

import types

import torch

from rollout_farm.trainer.config import load
from rollout_farm.trainer.guards import actions as guard_actions
from rollout_farm.trainer.guards import last_good
from rollout_farm.trainer.outputs import checkpoint
from rollout_farm.trainer.run import TrainingRun
from tests.unit.fake_run import fake_run


class Client:
    def __init__(self):
        self.calls = []

    def control(self, verb):
        self.calls.append(verb)


def make_run(tmp_path, rollback_to: str):
    cfg = load(
        None,
        ["guards.enable=true", "actor_rollout_ref.actor.ppo_mini_batch_size=8", f"guards.rollback_to={rollback_to}"],
    )
    run = fake_run(cfg, Client(), out=tmp_path)
    policy = run.policy
    run.restore = types.MethodType(TrainingRun.restore, run)

    def push():
        run.version += 1

    run.push = push
    checkpoint.save(tmp_path, 0, policy, run.opt, state(run))  # step 0, as TrainingRun saves it
    return run


def state(run) -> dict:
    return {"kl_coef": run.kl_ctrl.value, "mini_batch_size": run.mini_batch_size, "generated_tokens": 0}


def train_a_step(run, step: int) -> None:
    loss = run.policy(torch.randn(5, 4)).pow(2).sum()
    loss.backward()
    run.opt["actor"].step()
    run.opt["actor"].zero_grad()
    run.step, run.kl_ctrl.value, run.mini_batch_size, run.generated_tokens = step, 0.001 * step, 8 * step, 100 * step


def weights(run) -> dict:
    return {k: v.clone() for k, v in run.policy.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_rollback_returns_to_the_last_good_step_and_a_second_one_returns_there_again(tmp_path):
    run = make_run(tmp_path, "last_good")
    step0 = weights(run)
    run.last_good = last_good.keep(run)
    train_a_step(run, 1)
    run.last_good = last_good.keep(run)  # step 1: the guards let it be
    step1, moments = weights(run), run.opt["actor"].state_dict()["state"][0]["exp_avg"].clone()
    for bad in (2, 3):  # two bad steps in a row, each rolled back
        train_a_step(run, bad)
        assert not same(weights(run), step1)
        guard_actions.rollback(run)
        assert same(weights(run), step1) and not same(weights(run), step0)
        assert torch.equal(run.opt["actor"].state_dict()["state"][0]["exp_avg"], moments)
        assert (run.step, run.kl_ctrl.value, run.mini_batch_size) == (1, 0.001, 8)
        assert run.generated_tokens == 100 * bad  # the work done is not rolled back
    # the loop checks the guards before it pushes: the service serves step 1 already, nothing is paused or pushed
    assert run.client.calls == [] and run.version == 0


def test_rollback_to_checkpoint_lands_on_step_0_when_no_other_was_saved(tmp_path):
    run = make_run(tmp_path, "checkpoint")
    step0 = weights(run)
    train_a_step(run, 1)
    assert not last_good.wanted(run)  # nothing kept in memory with this setting
    train_a_step(run, 2)
    guard_actions.rollback(run)
    assert same(weights(run), step0) and run.step == 0
    # the service serves step 1 (pushed, kept): step 0 goes out as a new version, sampling paused meanwhile
    assert run.client.calls == ["pause", "resume"] and run.version == 1
