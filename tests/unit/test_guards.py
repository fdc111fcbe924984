"""The KL controller and the guards' decisions, without a service."""

import pytest

from trainer.config import load


def test_the_adaptive_kl_controller_moves_the_coefficient_towards_the_target():
    from verl.trainer.ppo import core_algos

    cfg = load(
        None, ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.01", "algorithm.kl_ctrl.horizon=100"]
    )
    ctrl = core_algos.get_kl_controller(cfg.algorithm.kl_ctrl)
    ctrl.update(current_kl=0.05, n_steps=10)
    assert ctrl.value > 0.001  # KL above target: penalise more
    high = ctrl.value
    ctrl.update(current_kl=0.001, n_steps=10)
    assert ctrl.value < high


def test_guards_raise_the_mini_batch_on_noisy_rewards_and_give_up_after_repeated_rollbacks():
    from trainer.guards import Guard, GuardConfig

    guard = Guard(GuardConfig(enable=True, max_rollbacks=2))
    assert guard.check(kl=0.01, reward_var=0.35, mini_batch_size=64)[0] == ["raise_mini_batch"]
    assert guard.check(kl=0.01, reward_var=0.35, mini_batch_size=128)[0] == []  # raised already
    actions, flags = guard.check(kl=0.03, reward_var=0.1, mini_batch_size=128)
    assert actions == [] and flags == {"guard_kl_over_target": True, "guard_reward_std_over_target": True}
    assert guard.check(kl=0.06, reward_var=0.1, mini_batch_size=128)[0] == ["rollback"]
    assert guard.check(kl=0.06, reward_var=0.1, mini_batch_size=128)[0] == ["rollback"]
    with pytest.raises(RuntimeError, match="after 2 rollbacks"):
        guard.check(kl=0.06, reward_var=0.1, mini_batch_size=128)
    assert Guard(GuardConfig()).check(kl=1.0, reward_var=1.0, mini_batch_size=64)[0] == []  # off by default
