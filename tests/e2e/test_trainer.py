"""The trainer against the real service: every estimator, micro-batches, the KL guard's rollback, resumes after
a kill."""

import json
import math
import os
import signal
import subprocess
import time

import httpx
import pytest
import torch

from rollout_farm.trainer.algorithms.estimators import adaptive_lambda
from rollout_farm.trainer.config import load
from tests.conftest import TOKEN
from tests.e2e.commands import farm_train


def config(service, tiny_model, tmp_path, *overrides):
    return load(
        None,
        [
            f"trainer.service_url={service}",
            f"actor_rollout_ref.model.path={tiny_model}",
            "trainer.task=arith",
            "trainer.total_training_steps=1",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=0.01",
            f"trainer.default_local_dir={tmp_path}",
            "trainer.reward=test_float_ties",
            *overrides,
        ],
    )  # rewards that vary


def guarded_run(service, tiny_model, tmp_path, *overrides):
    """A TrainingRun on config(...) with the guards on (guards.enable=true) and `overrides`."""
    from rollout_farm.trainer.run import TrainingRun

    return TrainingRun(config(service, tiny_model, tmp_path, "guards.enable=true", *overrides), TOKEN)


def guard_actions(action: str) -> float:
    """How many times the guards took `action` in this process (their Prometheus counter)."""
    from rollout_farm.trainer.guards.checks import ACTIONS

    return ACTIONS.labels(action)._value.get()


@pytest.mark.parametrize(
    "estimator, extra",
    [
        ("gae", []),
        ("adaptive_gae", []),
        ("control_variate", []),
        ("rloo", []),
        ("reinforce_plus_plus", []),
        ("reinforce_plus_plus_baseline", ["actor_rollout_ref.actor.old_logprobs=rollout"]),
        (
            "grpo",
            [
                "algorithm.use_kl_in_reward=true",
                "algorithm.kl_ctrl.type=adaptive",
                "algorithm.kl_ctrl.target_kl=0.01",
                "algorithm.kl_ctrl.horizon=10",
                "actor_rollout_ref.actor.use_kl_loss=true",
            ],
        ),
    ],
)
def test_each_estimator_trains_a_step_against_the_service(service, tiny_model, tmp_path, estimator, extra):
    from rollout_farm.trainer.loop import train
    from rollout_farm.trainer.run import TrainingRun

    trainer = TrainingRun(config(service, tiny_model, tmp_path, f"algorithm.adv_estimator={estimator}", *extra), TOKEN)
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    summary = train(trainer)
    step = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["step"] == 1 and summary["final_weight_version"] == trainer.version
    from rollout_farm.trainer.outputs.step_metrics import STEP_GAUGES

    assert STEP_GAUGES["weight_version"]._value.get() == trainer.version and STEP_GAUGES["step"]._value.get() == 1
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.state_dict().items())  # the policy moved
    assert ("vf_loss" in step) == (estimator in {"gae", "adaptive_gae", "control_variate"})
    if estimator == "adaptive_gae":  # the documented rule on this batch's reward variance (no KL in these rewards)
        assert step["lam"] == pytest.approx(
            adaptive_lambda(step["reward_std"] ** 2, 0.2, step["response_len"], 512), abs=1e-4
        )  # metrics.jsonl rounds to 5 decimals
    if "algorithm.use_kl_in_reward=true" in extra:
        assert (
            step["kl_in_reward"] == 0.0 and step["kl_coef"] < 0.001
        )  # step 1 samples the reference: KL 0 < target, so beta falls
    if "actor_rollout_ref.actor.old_logprobs=rollout" not in extra:
        # on-policy at temperature 1: the recomputed logprobs are those the service sampled with
        assert step["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
        assert abs(step["rollout_corr/kl"]) < 1e-3 and step["rollout_corr/unknown_fraction"] == 0.0


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_add_up_to_the_same_step(service, tiny_model, tmp_path, loss_agg_mode):
    """ppo_micro_batch_size_per_gpu=3 (gradient accumulation over uneven micro-batches: 16 samples -> 3+3+3+3+3+1) takes
    the step the whole mini-batch takes: same rollouts (same seed, same starting weights), same losses, same gradients.
    (Weights are not compared: Adam turns rounding-level differences in near-zero gradients into steps of lr.)"""
    from rollout_farm.trainer.loop import train
    from rollout_farm.trainer.run import TrainingRun

    trainers, rows = [], []
    for name, micro in (("whole", []), ("micro", ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])):
        trainer = TrainingRun(
            config(
                service,
                tiny_model,
                tmp_path / name,
                "trainer.resume_mode=disable",
                "algorithm.adv_estimator=control_variate",
                f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode}",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                *micro,
            ),
            TOKEN,
        )
        train(trainer)
        trainers.append(trainer)
        rows.append(json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1]))
    for key in ("reward_mean", "pg_loss", "kl_ref", "kl_loss", "entropy", "grad_norm", "vf_loss"):
        assert rows[1][key] == pytest.approx(rows[0][key], rel=1e-4, abs=1e-6), key
    for model in ("policy", "critic"):  # the one optimizer step's (clipped) gradients are still on the parameters
        whole, micro = (dict(getattr(t, model).named_parameters()) for t in trainers)
        assert all(torch.allclose(whole[k].grad, micro[k].grad, rtol=1e-4, atol=1e-7) for k in whole), model
        assert any(p.grad.abs().sum() > 0 for p in whole.values())


def test_the_kl_guard_rolls_back_and_the_service_serves_the_checkpoint(service, tiny_model, tmp_path, client):
    """A KL threshold of 1e-9 trips after the first step: the guards read the updated policy's KL before its push, so
    the trainer restores step 0 and pushes nothing (the service never served the bad policy). The service's logprobs
    then equal the initial model's: it serves the last good weights."""
    from transformers import AutoModelForCausalLM

    from rollout_farm.trainer.loop import train

    rollbacks = guard_actions("rollback")
    trainer = guarded_run(
        service,
        tiny_model,
        tmp_path,
        "guards.kl_rollback=1e-9",
        "guards.variance_raise=10",  # this test is about the KL guard
        "actor_rollout_ref.actor.optim.lr=0.05",
    )
    start = trainer.version
    train(trainer)
    step = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["guard_actions"] == ["rollback"] and guard_actions("rollback") == rollbacks + 1
    assert trainer.generated_tokens == step["generated_tokens"] > 0  # the work counter does not roll back
    assert trainer.version == start == client.weights_version().version  # nothing pushed: neither step nor rollback
    initial = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert all(torch.equal(v, initial.state_dict()[k]) for k, v in trainer.policy.state_dict().items())
    from rollout_farm.services import protocol as P

    prompt = trainer.tok("Q: 3+4\nA:", add_special_tokens=False).input_ids
    out = client.rollouts(
        P.RolloutRequest(
            prompts=[P.Prompt(token_ids=prompt)], sampling_params=P.SamplingParams(temperature=0, max_new_tokens=6)
        )
    )
    sample = out.groups[0].samples[0]
    with torch.no_grad():
        logits = initial(torch.tensor([prompt + sample.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4) and not any(
        r["paused"] for r in httpx.get(f"{service}/readyz").json()["replicas"]
    )


def test_the_variance_guard_raises_the_mini_batch_and_the_next_step_takes_fewer_optimizer_steps(
    service, tiny_model, tmp_path
):
    """4 groups in mini-batches of 1: 4 optimizer steps a step. A variance threshold every batch crosses raises the
    mini-batch to 2 groups after step 1, so step 2 takes 2; the raise is logged and counted."""
    from rollout_farm.trainer.loop import train

    raises = guard_actions("raise_mini_batch")
    trainer = guarded_run(
        service,
        tiny_model,
        tmp_path,
        "trainer.total_training_steps=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "guards.kl_rollback=100",
        "guards.variance_statistic=reward_std",
        "guards.variance_raise=1e-6",
        "guards.raised_mini_batch_size=2",
    )
    train(trainer)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["optimizer_steps"] for s in steps] == [4, 2]
    assert [s["ppo_mini_batch_size"] for s in steps] == [1, 2]  # the size each step trained with
    assert steps[0]["guard_actions"] == ["raise_mini_batch"] and steps[1]["guard_actions"] == []
    assert guard_actions("raise_mini_batch") == raises + 1


def test_the_noise_scale_guard_acts_on_the_measured_noise_scale(service, tiny_model, tmp_path):
    """guards.variance_statistic=grad_noise_scale: each step logs the noise scale measured from its micro-batches,
    and the guard raises the mini-batch exactly when that scale over the mini-batch's samples passes the threshold.
    (Two micro-batches give a noisy estimate, so the test checks the decision against the figure, not a sign.)"""
    from rollout_farm.trainer.loop import train

    trainer = guarded_run(
        service,
        tiny_model,
        tmp_path,
        "trainer.total_training_steps=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "guards.kl_rollback=100",
        "guards.variance_statistic=grad_noise_scale",
        "guards.variance_raise=0.5",
        "guards.raised_mini_batch_size=4",
    )
    train(trainer)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = steps[0]
    samples = 2 * trainer.cfg.actor_rollout_ref.rollout.n
    measured = math.inf if first["grad_noise_scale"] is None else first["grad_noise_scale"] / samples
    assert first["guard_variance"] == pytest.approx(measured, rel=1e-4)
    assert first["guard_actions"] == (["raise_mini_batch"] if measured > 0.5 else [])
    assert steps[1]["ppo_mini_batch_size"] == (4 if measured > 0.5 else 2)
    assert all("grad_noise_trace" in s and "grad_noise_g2" in s for s in steps)


def test_a_killed_trainer_resumes_from_its_last_checkpoint(service, tiny_model, tmp_path):
    cmd = farm_train(
        service,
        tiny_model,
        *"--task arith --steps 8 --train-batch-size 4 --n 4 --ppo-mini-batch-size 2 --lr 0.01 --out".split(),
        str(tmp_path),
        *"trainer.save_freq=1".split(),
    )
    env = {**os.environ, "FARM_API_TOKEN": TOKEN}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, pointer = time.monotonic() + 300, tmp_path / "checkpoints" / "latest"

    def latest_step() -> int:  # `latest` names a checkpoint once it is whole (its folder is renamed in first)
        return int(pointer.read_text().split("_")[1]) if pointer.exists() else 0

    while latest_step() < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "the trainer ended before its third checkpoint"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = latest_step()
    assert 3 <= killed_at < 8 and not (tmp_path / "summary.json").exists()
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = next(json.loads(line) for line in again.stdout.splitlines() if '"resumed"' in line)
    assert resumed["step"] == killed_at
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[-(8 - killed_at) :] == list(range(killed_at + 1, 9)) and set(range(1, 9)) <= set(steps)
    assert json.loads((tmp_path / "summary.json").read_text())["final_weight_version"] > 0


def test_a_killed_queue_trainer_resumes_and_gets_its_unacked_groups_again(service, tiny_model, tmp_path):
    """rollout_source=queue: the trainer leases groups and acks them after each step. Killed while it holds a
    lease, it loses nothing: the restarted trainer resumes from its checkpoint and the queue redelivers the
    groups once the 3 s lease runs out. (With queue_max_staleness=0 they would be dropped as stale and their
    prompts generated again instead.) The lease is counted while the trainer is frozen, before the kill: read after
    it, on a loaded machine, the lease had already run out (a CI failure)."""
    source = "resume-q"
    cmd = farm_train(
        service,
        tiny_model,
        *"--task arith --steps 6 --train-batch-size 4 --n 4 --ppo-mini-batch-size 4 --lr 0.01 --out".split(),
        str(tmp_path),
        *"trainer.save_freq=1 trainer.rollout_source=queue".split(),
        f"trainer.queue_source={source}",
        *"trainer.queue_lease_s=3 trainer.queue_max_staleness=100".split(),
        "actor_rollout_ref.actor.old_logprobs=recompute",
    )  # older groups are used, with the IS correction
    env = {**os.environ, "FARM_API_TOKEN": TOKEN}
    state = lambda: next((s for s in httpx.get(f"{service}/v1/queue/sources").json() if s["name"] == source), None)  # noqa: E731
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the trainer ended before holding a lease after its second checkpoint"
            )
            if (tmp_path / "checkpoints" / "step_2").exists() and (state() or {}).get("leased", 0) > 0:
                proc.send_signal(signal.SIGSTOP)  # frozen, it cannot ack between the look and the kill
                held = state()["leased"]  # read now: the 3 s lease may run out before a read after the kill
                if held > 0:
                    break
                proc.send_signal(signal.SIGCONT)
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        acked_before = state()["acked"]
        again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        after = state()
        assert (
            held > 0 and after["redelivered"] >= 1 and after["leased"] == 0
        )  # the killed trainer's lease came back, and was used
        assert after["acked"] > acked_before
        steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert steps[-1]["step"] == 6 and sum(s["redelivered_groups"] > 0 for s in steps) >= 1
    finally:
        proc.kill()
        httpx.delete(f"{service}/v1/queue/sources/{source}", headers={"Authorization": f"Bearer {TOKEN}"})


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "control_variate"])
def test_a_step_on_two_turn_episodes_trains_the_sampled_tokens_only(service, tiny_model, tmp_path, estimator):
    """data.env: each group is n two-turn episodes (tests/farm_plugins.py:Flaky, "scored"), trained through their
    loss mask. The trainer's recomputed logprobs over the whole multi-turn sequence equal the service's on every
    sampled token (rollout_is_mean 1, KL 0): the tokens it trains on are the ones the engine sampled, and the
    observation between the turns is context."""
    from rollout_farm.trainer.loop import train
    from rollout_farm.trainer.run import TrainingRun

    overrides = [
        "data.env=test_flaky",
        "data.env_params={behaviour: scored}",
        "data.max_turns=2",
        "data.max_response_length=6",
        f"algorithm.adv_estimator={estimator}",
    ]
    trainer = TrainingRun(config(service, tiny_model, tmp_path, *overrides), TOKEN)
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    summary = train(trainer)
    step = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["step"] == 1 and summary["final_weight_version"] == trainer.version
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.state_dict().items())
    assert 0 < step["response_len"] <= 12  # two sampled turns of at most 6 tokens: the mask, not the span
    assert step["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
    assert abs(step["rollout_corr/kl"]) < 1e-3
