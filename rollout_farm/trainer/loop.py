"""The RL loop, one call per phase (slime's train.py is the model):

    pull rollouts -> advantages -> update actor and critic -> guards -> push weights -> log -> checkpoint

The guards read the updated policy's KL before it is pushed: a step they roll back is never served, evaluated or
reported to the samplers (under async training the queue never generates from it), and its metrics record why.

Each phase lives in its own module: sync/rollouts.py, algorithms/advantages.py, actor.py, critic.py, sync/weights.py,
guards/checks.py and guards/actions.py, outputs/step_metrics.py, outputs/checkpoint.py (all under
rollout_farm/trainer/). The run's state is a TrainingRun (rollout_farm/trainer/run.py).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import replace
from functools import partial

import torch
from tqdm import tqdm

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmError
from rollout_farm.trainer import distributed
from rollout_farm.trainer.actor import ActorInputs, update_actor
from rollout_farm.trainer.algorithms import losses, rollout_correction
from rollout_farm.trainer.algorithms.advantages import compute_advantages
from rollout_farm.trainer.algorithms.forward import (
    in_micro_batches,
    policy_and_reference,
    response_values,
    temperatures,
)
from rollout_farm.trainer.algorithms.noise_scale import noise_scale
from rollout_farm.trainer.batch import Batch, broadcast_batch
from rollout_farm.trainer.config import TrainerConfig
from rollout_farm.trainer.critic import update_critic
from rollout_farm.trainer.evaluate import evaluate
from rollout_farm.trainer.guards import last_good
from rollout_farm.trainer.guards.actions import carry_out
from rollout_farm.trainer.guards.checks import GUARD_ACTIONS
from rollout_farm.trainer.minibatches import mini_batches
from rollout_farm.trainer.outputs import staleness_metrics, step_metrics
from rollout_farm.trainer.run import TrainingRun
from rollout_farm.trainer.sync import rollouts

log = logging.getLogger("farm.trainer")


def train(run: TrainingRun) -> dict:
    """Steps run.step + 1 to trainer.total_training_steps, with held-out accuracy before and after (eval_size);
    returns the summary, also written to summary.json."""
    t = run.cfg.trainer
    summary: dict = {"config": run.cfg.model_dump()}
    if t.eval_size and run.step == 0 and run.rank == 0:
        summary["before"] = held_out_accuracy(run)
    bar, accuracy = progress_bar(run), None
    if last_good.wanted(run):
        run.last_good = last_good.keep(run)  # the step the run starts from
    began = time.perf_counter()
    for step in bar:
        start = time.perf_counter()
        batch = broadcast_batch(rollouts.pull(run) if run.rank == 0 else None)
        if batch is None:  # every group was filtered out: nothing to learn from this step
            log.warning("empty_batch", extra={"step": step})
            continue
        batch = batch.to(run.device)
        metrics = train_step(run, batch)
        run.step = step
        variance = variance_statistics(run, batch, metrics)
        # before the push: a policy the guards roll back is never served, evaluated or reported to the samplers
        actions, flags = check_guards(run, metrics["kl_ref"], variance)
        kept = "rollback" not in actions
        if kept:
            metrics["push_seconds"] = timed(run.push)
        if run.rank == 0:
            seconds = time.perf_counter() - start
            metrics |= step_metrics.batch_metrics(batch, seconds) | counters(run, flags, actions)
            metrics |= step_metrics.pull_metrics(run.pull_stats, seconds) | {"elapsed_s": time.perf_counter() - began}
            report(run, metrics, variance["reward_var"], kept)
        for action in actions:
            carry_out(run, action)
        if kept and run.out and checkpoint_due(t, step):  # a rolled-back step saves nothing
            run.save()
        if kept and last_good.wanted(run):
            run.last_good = last_good.keep(run)
        rollouts.ack(run)  # after the checkpoint: killed before it, a trainer gets these groups again; after, not
        accuracy = metrics.get("val_accuracy", accuracy)  # held-out, every trainer.test_freq steps
        shown = {"acc": f"{accuracy:.3f}"} if accuracy is not None else {}
        bar.set_postfix(reward=f"{batch.rewards.mean().item():.3f}", kl=f"{metrics['kl_ref']:.4f}", **shown)
    if t.eval_size and run.rank == 0:
        summary["after"] = held_out_accuracy(run)
    summary["final_weight_version"] = run.version  # with LoRA, the adapter's version
    if run.cfg.lora:
        summary["adapter"] = run.cfg.adapter_name
    if run.out and run.rank == 0:
        (run.out / "summary.json").write_text(json.dumps(summary, indent=2))
    distributed.barrier()
    return summary


def train_step(run: TrainingRun, b: Batch) -> dict:
    """KL, advantages and the rollout correction of the batch, then the PPO epochs, then the updated policy's KL;
    the step's metrics."""
    a = run.cfg.actor_rollout_ref.actor
    old_lp, ref_lp, kl_exact, kl_fixed, values = no_grad_passes(run, b)
    metrics = kl_readings(b, old_lp, ref_lp, kl_fixed, kl_exact) | staleness_metrics.staleness_metrics(b, run.version)
    weights, mask, corr = rollout_correction.correction(old_lp, b, run.cfg.algorithm.rollout_correction)
    corr |= staleness_metrics.offpolicy_correction(
        b, run.version, old_lp, weights, mask, run.cfg.algorithm.rollout_correction
    )
    policy_lp = old_lp  # pi_T's own: the KL in the reward reads these, never the nucleus q (it would add -log Z)
    if a.old_logprobs == "rollout":  # verl's bypass mode: the ratio is against the distribution that sampled
        old_lp = torch.where(b.sampling_known.bool()[:, None], b.sampling_logprobs, old_lp)
        weights = b.importance_weights[:, None] * b.response_mask
    kl_before = metrics["kl_ref_before"]
    adv, returns, adv_metrics = compute_advantages(run.cfg, run.kl_ctrl, b, policy_lp, ref_lp, values, kl_before)
    metrics |= corr | adv_metrics
    metrics |= ppo_update(run, replace(b, response_mask=mask.long()), adv, old_lp, ref_lp, weights, values, returns)
    metrics["kl_ref"], metrics["kl_ref_sampled"] = updated_kl(run, b)
    return metrics


def no_grad_passes(run: TrainingRun, b: Batch) -> tuple[torch.Tensor, ...]:
    """The policy's and the reference's logprobs, the exact per-position KL between them at each sample's
    temperature and at algorithm.kl_temperature (all (B, R)), and the critic's values (or None)."""
    old_lp, ref_lp, kl, kl_fixed = policy_and_reference_pass(run, b)
    values = None
    if run.critic is not None:
        critic_micro = (
            run.cfg.critic.ppo_micro_batch_size_per_gpu or run.cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
        )
        with torch.no_grad():
            values = in_micro_batches(lambda mb: response_values(run.critic, mb), b, critic_micro)
    return old_lp, ref_lp, kl, kl_fixed, values


def policy_and_reference_pass(run: TrainingRun, b: Batch) -> tuple[torch.Tensor, ...]:
    """forward.policy_and_reference over the batch, without gradients, in the actor's micro-batches, the logits
    divided by each sample's temperature; the KL also at algorithm.kl_temperature."""
    a, kl_t = run.cfg.actor_rollout_ref.actor, run.cfg.algorithm.kl_temperature
    with torch.no_grad():
        return in_micro_batches(
            lambda mb: policy_and_reference(run.policy, run.ref, mb, temperatures(mb, a), kl_t),
            b,
            a.ppo_micro_batch_size_per_gpu,
        )


def kl_readings(
    b: Batch, old_lp: torch.Tensor, ref_lp: torch.Tensor, kl_fixed: torch.Tensor, kl_sampled: torch.Tensor | None = None
) -> dict:
    """The KL to the reference of the policy that sampled the batch: kl_ref_before, exact per response token at
    algorithm.kl_temperature (the adaptive controller's); the same at each sample's own temperature
    (kl_ref_before_sampled), and the one-token estimates k1 and k3 beside them, for comparison."""
    mask = b.response_mask
    kl_sampled = kl_fixed if kl_sampled is None else kl_sampled
    return {
        "kl_ref_before": losses.masked_mean(kl_fixed, mask).item(),
        "kl_ref_before_sampled": losses.masked_mean(kl_sampled, mask).item(),
        "kl_k1": losses.masked_mean(losses.kl_penalty(old_lp, ref_lp, "kl"), mask).item(),
        "kl_k3": losses.masked_mean(losses.kl_penalty(old_lp, ref_lp, "low_var_kl"), mask).item(),
    }


def updated_kl(run: TrainingRun, b: Batch) -> tuple[float, float]:
    """kl_ref: the exact KL to the reference of the policy after the step's update, the one pushed next, on the
    step's prefixes, at algorithm.kl_temperature (what the guards and the samplers' policy stats read); and the
    same at each sample's own temperature (kl_ref_sampled, logged beside it)."""
    _, _, sampled, fixed = policy_and_reference_pass(run, b)
    mask = b.response_mask
    return losses.masked_mean(fixed, mask).item(), losses.masked_mean(sampled, mask).item()


def ppo_update(
    run: TrainingRun,
    b: Batch,
    adv: torch.Tensor,
    old_lp: torch.Tensor,
    ref_lp: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor | None,
    returns: torch.Tensor,
) -> dict:
    """ppo_epochs epochs over mini-batches of whole groups: an actor step on each, and a critic step on the same.
    Returns the mean of each metric over the mini-batches, and the number of optimizer steps."""
    a = run.cfg.actor_rollout_ref.actor
    measure_noise = run.cfg.guards.variance_statistic == "grad_noise_scale"
    run.policy.train()
    stats: dict[str, list[float]] = {}
    actor = ActorInputs(run.policy, b, adv, old_lp, ref_lp, weights, a)
    scale = a.loss_scale_factor or rollouts.max_new_tokens(run)
    for _ in range(a.ppo_epochs):
        for mb in mini_batches(b, run.mini_batch_size, run.rank, run.world, scale):
            row = update_actor(actor, run.opt["actor"], mb, measure_noise)
            if run.critic is not None:
                row.update(update_critic(run.critic, run.opt["critic"], b, mb, values, returns, run.cfg))
            for k, v in row.items():
                stats.setdefault(k, []).append(float(v))
    run.policy.eval()
    return {k: sum(v) / len(v) for k, v in stats.items()} | {"optimizer_steps": len(stats["pg_loss"])}


def variance_statistics(run: TrainingRun, b: Batch, metrics: dict) -> dict[str, float]:
    """What guards.variance_statistic can pick: the batch's reward std and variance, the advantage variance and,
    when measured, the gradient noise scale over the mini-batch's sample count (above 1: the mini-batch is below
    the critical batch size). The noise scale itself, in samples, goes into metrics."""
    reward_var = b.rewards.var(unbiased=False).item()
    out = {"reward_std": reward_var**0.5, "reward_var": reward_var, "adv_var": metrics["adv_var"]}
    if "grad_noise_trace" in metrics:
        scale = noise_scale([metrics["grad_noise_trace"]], [metrics["grad_noise_g2"]])
        metrics["grad_noise_scale"] = scale  # None: no gradient signal above the noise
        samples = run.mini_batch_size * run.cfg.actor_rollout_ref.rollout.n
        out["grad_noise_scale"] = math.inf if scale is None else scale / samples
    return out


def check_guards(run: TrainingRun, kl: float, variance: dict[str, float]) -> tuple[list[str], dict]:
    """The guard's actions for this step, as rank 0 decided them, and the flags to log."""
    actions, flags = run.guard.check(kl, variance, run.mini_batch_size)
    on = distributed.broadcast_ints([int(a in actions) for a in GUARD_ACTIONS], len(GUARD_ACTIONS))
    return [a for a, o in zip(GUARD_ACTIONS, on) if o], flags


def counters(run: TrainingRun, flags: dict, actions: list[str]) -> dict:
    """The step's metrics beyond the losses and the batch's: where the run stands, and what the guard said."""
    return {
        "step": run.step,
        "weight_version": run.version,
        **flags,
        "generated_tokens": run.generated_tokens,
        "kl_coef": run.kl_ctrl.value,
        "ppo_mini_batch_size": run.mini_batch_size,
        "guard_actions": actions,
        "world_size": run.world,
        "redelivered_groups": run.redelivered,
    }


def report(run: TrainingRun, metrics: dict, reward_var: float, kept: bool) -> None:
    """Rank 0: for a step the guards kept (`kept`), score the held-out problems every test_freq steps and tell the
    service the step's KL and reward variance (its samplers may adapt to them); record the metrics of every step. A
    rolled-back step's policy is discarded: nothing scores it, and the samplers keep the last kept step's stats."""
    t = run.cfg.trainer
    if kept and t.eval_size and t.test_freq > 0 and run.step % t.test_freq == 0:
        scored = held_out_accuracy(run)
        metrics["val_accuracy"] = scored["accuracy"]
        if "number_accuracy" in scored:  # the right number in any format: the skill, not only the format
            metrics["val_number_accuracy"] = scored["number_accuracy"]
    if kept:
        report_policy_stats(run, P.PolicyStats(kl=max(0.0, metrics["kl_ref"]), reward_var=reward_var, step=run.step))
    step_metrics.record(run.out, metrics)


def report_policy_stats(run: TrainingRun, stats: P.PolicyStats) -> None:
    """POST /v1/policy_stats. It takes the admin's token: a LoRA run on a tenant's token is refused, and from then on
    reports nothing (the samplers' stats are the farm's, not one tenant's)."""
    if run.cfg.lora and not run.report_stats:
        return
    try:
        run.client.report_policy_stats(stats)
    except FarmError as e:
        if not (run.cfg.lora and e.status in (401, 403)):
            raise
        run.report_stats = False
        log.warning("policy_stats_refused", extra={"status": e.status, "why": "a tenant's token: not reported"})


def timed(call) -> float:
    """Seconds `call()` took."""
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def held_out_accuracy(run: TrainingRun) -> dict:
    """Greedy accuracy on the held-out problems, sampled from the policy the trainer pushed last (its adapter's
    version with LoRA)."""
    render = partial(rollouts.render_prompt, run.tok)
    return evaluate(
        run.client, run.task, render, run.cfg.trainer.eval_size, adapter=rollouts.adapter_ref(run)
    ).as_dict()


def progress_bar(run: TrainingRun) -> tqdm:
    t = run.cfg.trainer
    steps = range(run.step + 1, t.total_training_steps + 1)
    return tqdm(
        steps,
        desc="training",
        unit="step",
        file=sys.stderr,
        initial=run.step,
        total=t.total_training_steps,
        disable=run.rank != 0,
    )


def checkpoint_due(t: TrainerConfig, step: int) -> bool:
    """Every save_freq steps (-1: never), and at the last step."""
    return t.save_freq > 0 and step % t.save_freq == 0 or step == t.total_training_steps
