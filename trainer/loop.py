"""The RL loop. One step: pull rollouts -> (KL penalty) -> advantages -> PPO (and critic) update -> push weights
-> guards -> checkpoint -> log.

The trainer owns the policy, a frozen reference, and a critic when the estimator needs values; the service
owns generation. They meet only over HTTP: trajectories come back as JSON, weights go out as safetensors.

Old logprobs (`actor_rollout_ref.actor.old_logprobs`):
  rollout    the logprobs the service reported: raw-model logprobs of the very weights the trainer holds
             (every sample's weight_version is checked), so no forward pass is needed. The default.
  recompute  a forward pass of the trainer's policy before the update. When samples were drawn off-policy
             (a lagging weight version, importance resampling), the policy-gradient term of each token is
             weighted by the truncated importance ratio min(exp(old - rollout), rollout_is_threshold).
"""

from __future__ import annotations

import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
from verl.trainer.ppo import core_algos

from services import protocol as P
from services.client import FarmClient
from services.engine.torch_engine import canonical_state_dict
from services.models import resolve_model
from services.tasks import TASKS, Problem
from trainer import checkpoint, distributed, losses
from trainer.config import Config
from trainer.estimators import ESTIMATORS, AdvInput
from trainer.evaluate import evaluate
from trainer.guards import STEP_GAUGES, Guard
from trainer.batch import Batch, broadcast_batch, make_batch
from trainer.forward import in_micro_batches, response_logprobs, response_values

log = logging.getLogger("farm.trainer")
GUARD_ACTIONS = ("rollback", "raise_mini_batch")


class Trainer:
    def __init__(self, cfg: Config, token: str = ""):
        self.cfg, t = cfg, cfg.trainer
        self.device = distributed.resolve_device(t.device)
        self.rank, self.world = distributed.init_from_env(self.device)  # rank 0 alone talks to the service and writes files
        torch.manual_seed(t.seed)
        self.rng = random.Random(t.seed)
        path = resolve_model(cfg.actor_rollout_ref.model.path)
        actor = cfg.actor_rollout_ref.actor
        self.tok = AutoTokenizer.from_pretrained(path)
        self.policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        self.ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device).eval().requires_grad_(False)
        self.opt = {"actor": torch.optim.AdamW(self.policy.parameters(), lr=actor.optim.lr, weight_decay=actor.optim.weight_decay)}
        self.critic = None
        if cfg.critic_enabled:
            self.critic = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32).to(self.device)
            self.opt["critic"] = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic.optim.lr, weight_decay=cfg.critic.optim.weight_decay)
        self.kl_ctrl = core_algos.get_kl_controller(cfg.algorithm.kl_ctrl)
        self.mini_batch_size = actor.ppo_mini_batch_size
        self.guard = Guard(cfg.guards)
        if t.metrics_port and self.rank == 0:
            from prometheus_client import start_http_server

            start_http_server(t.metrics_port)
        self.task = TASKS.get(t.task)()
        self.client = FarmClient(t.service_url, token)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.generated_tokens = 0  # by the service for this trainer, filtered-out work included
        self.leased: list[str] = []  # queue items of the current step, acked once its weights are pushed
        self.redelivered = 0  # queue groups that came back from an earlier (killed) trainer's lease
        self.out = Path(t.default_local_dir) if t.default_local_dir else None
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
        self.step = 0
        self.version = self.client.weights_version().version if self.rank == 0 else 0
        resumed = checkpoint.latest(self.out) if self.out and t.resume_mode == "auto" else None
        if resumed:
            self.restore(resumed)
            log.info(json.dumps({"event": "resumed", "checkpoint": str(resumed), "step": self.step, "rank": self.rank}))
        if resumed or self.version > 0:  # version 0 is the model folder both sides loaded; anything later, we replace
            self.push()
        if self.out and not resumed:
            if self.rank == 0:
                (self.out / "metrics.jsonl").unlink(missing_ok=True)
            self.save()  # step 0: what a rollback before the first periodic checkpoint returns to

    # the loop ------------------------------------------------------------------
    def run(self) -> dict:
        t = self.cfg.trainer
        summary: dict = {"config": self.cfg.model_dump()}
        if t.eval_size and self.step == 0 and self.rank == 0:
            summary["before"] = self.evaluate()
        bar = tqdm(range(self.step + 1, t.total_training_steps + 1), desc="training", unit="step", file=sys.stderr,
                   initial=self.step, total=t.total_training_steps, disable=self.rank != 0)
        for step in bar:
            start = time.perf_counter()
            batch = broadcast_batch(self.pull() if self.rank == 0 else None)
            if batch is None:  # every group was filtered out: nothing to learn from this step
                log.warning(json.dumps({"event": "empty_batch", "step": step}))
                continue
            batch = batch.to(self.device)
            metrics = self.train_step(batch)
            self.push()
            if self.leased:  # used: the queue may forget them
                self.client.queue_ack(self.leased)
                self.leased = []
            self.step = step
            reward_var = batch.rewards.var(unbiased=False).item()
            actions, flags = self.guard.check(metrics["kl_ref"], reward_var, self.mini_batch_size)
            actions = [GUARD_ACTIONS[i] for i, on in enumerate(distributed.broadcast_ints([int(a in actions) for a in GUARD_ACTIONS], 2)) if on]
            if self.rank == 0:
                metrics.update(self.batch_metrics(batch, time.perf_counter() - start), step=step, weight_version=self.version, **flags,
                               generated_tokens=self.generated_tokens, kl_coef=self.kl_ctrl.value, ppo_mini_batch_size=self.mini_batch_size,
                               guard_actions=actions, world_size=self.world, redelivered_groups=self.redelivered)
                if t.eval_size and t.test_freq > 0 and step % t.test_freq == 0:
                    metrics["val_accuracy"] = self.evaluate()["accuracy"]
                self.client.report_policy_stats(P.PolicyStats(kl=max(0.0, metrics["kl_ref"]), reward_var=reward_var, step=step))
                self.record(metrics)
                for key, gauge in STEP_GAUGES.items():
                    gauge.set(metrics.get(key, 0.0))
            for action in actions:
                self.act(action)
            if self.out and "rollback" not in actions and (t.save_freq > 0 and step % t.save_freq == 0 or step == t.total_training_steps):
                self.save()
            bar.set_postfix(reward=f"{batch.rewards.mean().item():.3f}", kl=f"{metrics['kl_ref']:.4f}")
        if t.eval_size and self.rank == 0:
            summary["after"] = self.evaluate()
        summary["final_weight_version"] = self.version
        if self.out and self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        distributed.barrier()
        return summary

    def act(self, action: str) -> None:
        """Carry out a guard action, and log it."""
        if action == "raise_mini_batch":
            was, self.mini_batch_size = self.mini_batch_size, self.cfg.guards.raised_mini_batch_size
            log.warning(json.dumps({"event": "guard_action", "action": action, "step": self.step, "from": was, "to": self.mini_batch_size}))
        elif action == "rollback":
            ckpt = checkpoint.latest(self.out) if self.out else None
            if ckpt is None:
                raise RuntimeError("KL guard: no checkpoint to roll back to; set trainer.default_local_dir")
            if self.rank == 0:
                self.client.control("pause")
            try:
                bad_step = self.step
                self.restore(ckpt, rngs=False)  # new draws: the same ones could lead to the same blow-up
                self.push()  # the checkpoint's weights, as a new version
            finally:
                if self.rank == 0:
                    self.client.control("resume")
            log.warning(json.dumps({"event": "guard_action", "action": action, "step": bad_step, "to_step": self.step, "version": self.version}))

    def render(self, p: Problem) -> str:
        """The prompt text sent to the service: through the chat template when the model has one."""
        if self.tok.chat_template:
            return self.tok.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False, add_generation_prompt=True)
        return p.prompt

    def sampling(self) -> tuple[P.SamplingParams, P.SamplerSpec]:
        d, r = self.cfg.data, self.cfg.actor_rollout_ref.rollout
        params = P.SamplingParams(temperature=r.temperature, top_p=r.top_p, seed=self.rng.getrandbits(31),
                                  max_new_tokens=d.max_response_length or self.task.max_new_tokens)
        return params, P.SamplerSpec(name=r.sampler, params=dict(r.sampler_params))

    def pull(self) -> Batch | None:
        d, r = self.cfg.data, self.cfg.actor_rollout_ref.rollout
        problems = self.task.train_batch(self.rng, math.ceil(d.train_batch_size * d.oversample))
        prompts = [P.Prompt(text=self.render(p), ground_truth=p.answer) for p in problems]
        if self.cfg.trainer.rollout_source == "queue":
            groups = self.pull_queue(prompts)
        else:
            params, sampler = self.sampling()
            if sampler.name == "dynamic_group_filter" and len(problems) > d.train_batch_size:
                sampler.params.setdefault("target_groups", d.train_batch_size)
            req = P.RolloutRequest(prompts=prompts, n=r.n, sampling_params=params, sampler=sampler, reward=self.cfg.trainer.reward or self.task.reward,
                                   min_weight_version=self.version)
            out = self.client.rollouts(req)
            self.generated_tokens += out.filter.generated_tokens if out.filter else sum(g.generated_tokens or 0 for g in out.groups)
            groups = out.groups
        groups = [g for g in groups if g.samples]
        if not groups:
            return None
        batch = make_batch(groups, self.pad_id)
        stale = [v for v in batch.weight_versions if v != self.version]
        if stale and self.cfg.actor_rollout_ref.actor.old_logprobs == "rollout":
            raise RuntimeError(f"{len(stale)} samples came from weight versions {sorted(set(stale))}, expected {self.version}: "
                               "set actor_rollout_ref.actor.old_logprobs=recompute to train on them with a truncated importance correction")
        return batch

    def pull_queue(self, prompts: list[P.Prompt]) -> list[P.Group]:
        """Feed this step's prompts to the trainer's queue source and lease train_batch_size groups from it; they are
        acked after the step (see run). A group leased by a trainer that died comes back once its lease runs out."""
        t, want = self.cfg.trainer, self.cfg.data.train_batch_size
        name = t.queue_source or f"farm-trainer-{t.task}-{t.seed}"
        if not any(s.name == name for s in self.client.queue_sources()):
            params, sampler = self.sampling()
            self.client.queue_add_source(P.QueueSource(name=name, n=self.cfg.actor_rollout_ref.rollout.n, sampling_params=params.model_copy(update={"seed": None}),
                                                       sampler=sampler, reward=t.reward or self.task.reward, target_groups=want))
            log.info(json.dumps({"event": "queue_source_added", "source": name}))
        self.client.queue_add_prompts(name, prompts)
        items: list[P.QueueItem] = []
        deadline = time.monotonic() + 600
        while len(items) < want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"queue source {name!r} delivered {len(items)} of {want} groups in 600 s")
            got = self.client.queue_pull(P.PullRequest(source=name, max_groups=want - len(items), max_staleness=t.queue_max_staleness,
                                                       lease_s=t.queue_lease_s, wait_s=30))
            items += got.items
        self.leased = [i.item_id for i in items]
        self.redelivered += sum(i.deliveries > 1 for i in items)
        self.generated_tokens += sum(i.group.generated_tokens or 0 for i in items)
        return [i.group for i in items]

    # one update -------------------------------------------------------------------
    def train_step(self, b: Batch) -> dict:
        a, alg = self.cfg.actor_rollout_ref.actor, self.cfg.algorithm
        micro, critic_micro = a.ppo_micro_batch_size_per_gpu, self.cfg.critic.ppo_micro_batch_size_per_gpu or a.ppo_micro_batch_size_per_gpu
        with torch.no_grad():
            ref_lp = in_micro_batches(lambda mb: response_logprobs(self.ref, mb)[0], b, micro)
            old_lp = b.rollout_logprobs if a.old_logprobs == "rollout" else in_micro_batches(lambda mb: response_logprobs(self.policy, mb)[0], b, micro)
            values = in_micro_batches(lambda mb: response_values(self.critic, mb), b, critic_micro) if self.critic is not None else None
        token_rewards = losses.outcome_to_token_rewards(b.rewards, b.response_mask)
        metrics = {}
        if alg.use_kl_in_reward:  # verl's apply_kl_penalty: r_t - beta * KL_t, then the controller moves beta
            kld = losses.kl_penalty(old_lp, ref_lp, alg.kl_penalty) * b.response_mask
            token_rewards = token_rewards - self.kl_ctrl.value * kld
            current = losses.masked_mean(kld, b.response_mask).item()
            self.kl_ctrl.update(current_kl=current, n_steps=len(b))
            metrics["kl_in_reward"] = current
        adv, returns, info = ESTIMATORS.get(alg.adv_estimator)(AdvInput(
            token_rewards, b.response_mask, b.group_ids, values=values, gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, variance_threshold=alg.variance_threshold))
        metrics.update(info, adv_var=losses.masked_var(adv, b.response_mask).item())
        if a.old_logprobs == "recompute":  # truncated importance sampling against the rollout's behaviour logprobs
            tis = torch.exp(old_lp - b.rollout_logprobs).clamp(max=alg.rollout_is_threshold) * b.response_mask
            adv = adv * tis
            metrics["rollout_is_mean"] = losses.masked_mean(tis, b.response_mask).item()
        metrics.update(self.update(b, adv, old_lp, ref_lp, values, returns))
        return metrics

    def update(self, b: Batch, adv: torch.Tensor, old_lp: torch.Tensor, ref_lp: torch.Tensor, values: torch.Tensor | None,
               returns: torch.Tensor) -> dict:
        """PPO epochs over mini-batches of whole groups, and the critic's clipped value loss alongside. Each process trains
        its share of a mini-batch's groups in micro-batches; every loss is scaled by the whole mini-batch's token and
        sample counts, so the gradients summed over micro-batches and processes are those of the mini-batch."""
        a = self.cfg.actor_rollout_ref.actor
        self.policy.train()
        n_groups = int(b.group_ids.max()) + 1
        stats: dict[str, list[float]] = {}
        group_ids = torch.as_tensor(b.group_ids)
        for _ in range(a.ppo_epochs):
            for chunk in torch.randperm(n_groups).split(self.mini_batch_size):
                whole = torch.isin(group_ids, chunk)  # the mini-batch on every rank; this rank trains its share of the groups
                idx = torch.nonzero(torch.isin(group_ids, chunk[self.rank::self.world])).squeeze(-1)
                share = {"batch_num_tokens": b.response_mask[whole].sum().item(), "global_batch_size": int(whole.sum())}
                micros = idx.split(a.ppo_micro_batch_size_per_gpu or max(1, len(idx))) if len(idx) else ()
                totals, parts = torch.zeros(3, device=self.device), {}
                self.opt["actor"].zero_grad()
                for m in micros:
                    mb, mask = b.select(m), b.response_mask[m]
                    lp, entropy = response_logprobs(self.policy, mb, with_entropy=True)
                    pg_loss, pg = losses.ppo_loss(old_lp[m], lp, adv[m], mask, a.clip_ratio, a.clip_ratio_c, a.loss_agg_mode, share)
                    kl = losses.share_mean(losses.kl_penalty(lp, ref_lp[m], a.kl_loss_type), mask, share["batch_num_tokens"])
                    ent = losses.share_mean(entropy, mask, share["batch_num_tokens"])
                    (pg_loss - a.entropy_coeff * ent + (a.kl_loss_coef * kl if a.use_kl_loss else 0.0)).backward()
                    totals += torch.stack([pg_loss, kl, ent]).detach()
                    for k in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
                        parts.setdefault(k, []).append(float(pg.get(k, 0.0)))
                distributed.sum_gradients(self.policy)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), a.grad_clip)
                self.opt["actor"].step()
                pg_total, kl_total, ent_total = distributed.all_reduce_sum(totals).tolist()  # shares -> whole
                pg_means = {k.removeprefix("actor/"): sum(v) / len(v) for k, v in parts.items()}  # over this rank's micro-batches
                row = {"pg_loss": pg_total, "kl_ref": kl_total, "entropy": ent_total, "grad_norm": grad_norm.item(),
                       **{k: pg_means.get(k, 0.0) for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")}}
                if self.critic is not None:
                    row.update(self.update_critic(b, idx, share, values, returns))
                for k, v in row.items():
                    stats.setdefault(k, []).append(float(v))
        self.policy.eval()
        return {k: sum(v) / len(v) for k, v in stats.items()}

    def update_critic(self, b: Batch, idx: torch.Tensor, share: dict, values: torch.Tensor, returns: torch.Tensor) -> dict:
        """One clipped value-loss step on this rank's share of a mini-batch, in the critic's micro-batches."""
        a, c = self.cfg.actor_rollout_ref.actor, self.cfg.critic
        size = c.ppo_micro_batch_size_per_gpu or a.ppo_micro_batch_size_per_gpu or max(1, len(idx))
        loss_total, clipfracs = torch.zeros((), device=self.device), []
        self.opt["critic"].zero_grad()
        for m in (idx.split(size) if len(idx) else ()):
            mb = b.select(m)
            vf_loss, vf_clipfrac = core_algos.compute_value_loss(response_values(self.critic, mb), returns[m], values[m], b.response_mask[m].float(),
                                                                 c.cliprange_value, a.loss_agg_mode, **share)
            vf_loss.backward()
            loss_total += vf_loss.detach()
            clipfracs.append(float(vf_clipfrac))
        distributed.sum_gradients(self.critic)
        torch.nn.utils.clip_grad_norm_(self.critic.parameters(), a.grad_clip)
        self.opt["critic"].step()
        return {"vf_loss": distributed.all_reduce_sum(loss_total).item(), "vf_clipfrac": sum(clipfracs) / max(1, len(clipfracs))}

    # weights, checkpoints, metrics -------------------------------------------------------
    def push(self) -> None:
        """Send the policy as the next version and check the service serves it (rank 0; the other ranks hold the same weights)."""
        if self.rank != 0:
            return
        data = save({k: v.detach().cpu().contiguous() for k, v in canonical_state_dict(self.policy).items()})
        pushed = self.client.push_weights(data, self.client.weights_version().version + 1)
        served = self.client.weights_version().version
        if served != pushed.version:
            raise RuntimeError(f"pushed version {pushed.version} but the service serves {served}")
        self.version = served

    def save(self) -> None:
        if self.rank != 0:
            distributed.barrier()  # until rank 0 has written it
            return
        self._save()
        distributed.barrier()

    def _save(self) -> None:
        checkpoint.save(self.out, self.step, self.policy, self.opt, {"kl_coef": self.kl_ctrl.value, "mini_batch_size": self.mini_batch_size,
                                                                     "generated_tokens": self.generated_tokens, "config": self.cfg.model_dump()},
                        critic=self.critic, trainer_rng=self.rng)

    def restore(self, path: Path, rngs: bool = True) -> None:
        state = checkpoint.load(path, self.policy, self.opt, critic=self.critic, trainer_rng=self.rng if rngs else None, rngs=rngs)
        self.step, self.kl_ctrl.value = state["step"], state["kl_coef"]
        self.mini_batch_size, self.generated_tokens = state["mini_batch_size"], state["generated_tokens"]

    def batch_metrics(self, b: Batch, seconds: float) -> dict:
        tokens = int(b.response_mask.sum())
        return {"reward_mean": b.rewards.mean().item(), "reward_std": b.rewards.std(unbiased=False).item(), "response_len": tokens / len(b),
                "step_seconds": seconds, "tokens_per_s": tokens / seconds, "samples": len(b)}

    def evaluate(self) -> dict:
        return evaluate(self.client, self.task, self.render, self.cfg.trainer.eval_size).as_dict()

    def record(self, metrics: dict) -> None:
        line = json.dumps({"event": "train_step", **{k: round(v, 5) if isinstance(v, float) else v for k, v in metrics.items()}})
        log.info(line)
        if self.out:
            with (self.out / "metrics.jsonl").open("a") as f:
                f.write(line + "\n")
