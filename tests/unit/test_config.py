"""The trainer's config: the design preset, dotted overrides, errors that name the key and the fix."""

import pytest

from rollout_farm.trainer.config import PRESETS, ConfigError, load


def test_the_design_preset_holds_the_recommended_parameters():
    c = load(PRESETS / "design.yaml")
    r, a = c.actor_rollout_ref.rollout, c.actor_rollout_ref.actor
    assert (r.n, r.sampler, c.data.max_response_length) == (8, "kl_adaptive_temperature", 1024)
    assert r.sampler_params == {"base_temperature": 0.7, "low_temperature": 0.5, "top_p": 0.9, "kl_threshold": 0.02}
    # mini-batches count groups: 8 x n 8 = 64 samples, raised to 16 x 8 = 128
    assert (a.ppo_mini_batch_size, a.clip_ratio_c, a.ppo_epochs, c.data.train_batch_size) == (8, 3.0, 6, 64)
    alg = c.algorithm
    assert alg.use_kl_in_reward and alg.kl_penalty == "k1" and alg.kl_ctrl.kl_coef == 0.001
    assert (alg.kl_ctrl.type, alg.kl_ctrl.target_kl, alg.adv_estimator) == ("adaptive", 0.01, "control_variate")
    assert c.critic_enabled and c.guards.enable
    g = c.guards
    assert (g.kl_rollback, g.variance_statistic, g.variance_raise, g.raised_mini_batch_size) == (
        0.05,
        "reward_std",
        0.3,
        16,
    )


def test_a_mini_batch_raise_that_changes_nothing_is_refused():
    # 64 groups in mini-batches of 64: one optimizer step per epoch, and still one at 128
    with pytest.raises(ConfigError, match="guards.raised_mini_batch_size: .* would change nothing"):
        load(
            PRESETS / "design.yaml",
            ["actor_rollout_ref.actor.ppo_mini_batch_size=64", "guards.raised_mini_batch_size=128"],
        )


def test_dotted_overrides_are_parsed_as_yaml():
    c = load(
        PRESETS / "design.yaml",
        [
            "actor_rollout_ref.rollout.n=16",
            "algorithm.kl_ctrl.target_kl=0.02",
            "critic.enable=true",
            "actor_rollout_ref.rollout.sampler_params={target_groups: 4}",
        ],
    )
    assert c.actor_rollout_ref.rollout.n == 16 and c.algorithm.kl_ctrl.target_kl == 0.02
    assert c.actor_rollout_ref.rollout.sampler_params == {"target_groups": 4}
    assert load().algorithm.adv_estimator == "grpo" and not load().critic_enabled


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor_rollout_ref.rollout.nn=4", "actor_rollout_ref.rollout.nn: Extra inputs are not permitted (not a key"),
        (
            "actor_rollout_ref.actor.clip_ratio_c=0.5",
            "actor_rollout_ref.actor.clip_ratio_c: Input should be greater than 1",
        ),
        ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator: unknown 'ppo'; use one of"),
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size=0",
            "actor_rollout_ref.actor.ppo_mini_batch_size: Input should be greater than or equal to 1",
        ),
        ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type: Input should be 'fixed' or 'adaptive'"),
        ("critic.enable=false", "critic.enable: control_variate needs the critic's values"),
        (
            "algorithm.rollout_correction.rollout_rs=token_k9",
            "algorithm.rollout_correction: Value error, rollout_rs: unknown token_k9; use some of",
        ),
        ("algorithm.rollout_correction.rollout_rs=token_k1", "rollout_rs_threshold: required with rollout_rs"),
        ("algorithm.rollout_correction.rollout_is=tokens", "Input should be 'token' or 'sequence'"),
        ("n16", "write dotted.key=value"),
        ("trainer.device=gpu", "trainer.device: String should match pattern"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=None) as e:
        load(PRESETS / "design.yaml", [override])
    assert message in str(e.value)


def test_the_trainer_device_resolves_to_what_this_machine_has():
    import torch

    from rollout_farm.trainer.distributed import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(RuntimeError, match="trainer.device=cuda: torch here has no CUDA device"):
            resolve_device("cuda")
