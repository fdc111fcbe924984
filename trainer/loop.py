"""The RL loop. One step: pull rollouts -> advantages -> PPO update -> push weights -> log.

The trainer owns a copy of the policy and a frozen reference; the service owns generation.
They meet only over HTTP: trajectories come back as JSON, weights go out as safetensors.
"""

from __future__ import annotations

import json
import logging
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from services import protocol as P
from services.client import FarmClient
from services.engine.torch_engine import canonical_state_dict
from services.models import resolve_model
from services.tasks import TASKS, Problem
from trainer import algos
from trainer.evaluate import evaluate
from trainer.policy import Batch, make_batch, response_logprobs

log = logging.getLogger("farm.trainer")


@dataclass
class TrainConfig:
    """Trainer settings; the comment after each names the verl key it mirrors."""

    service_url: str = "http://127.0.0.1:8000"
    token: str = field(default="", repr=False)  # bearer token for weight pushes
    model: str = "arith-tiny"  # actor_rollout_ref.model.path; must be what the service serves
    task: str = "arith"  # prompt source in services.tasks
    steps: int = 40  # trainer.total_training_steps
    train_batch_size: int = 32  # data.train_batch_size: prompts per step
    n: int = 8  # actor_rollout_ref.rollout.n: samples per prompt
    temperature: float = 1.0  # actor_rollout_ref.rollout.temperature
    top_p: float = 1.0  # actor_rollout_ref.rollout.top_p
    sampler: str = "plain"  # the service's sampler (GET /v1/samplers); kl_adaptive_temperature reads the KL this trainer reports
    sampler_params: str = "{}"  # the sampler's params, as JSON
    oversample: float = 1.0  # prompts sent per step / train_batch_size (dynamic_group_filter keeps train_batch_size informative groups)
    max_new_tokens: int | None = None  # data.max_response_length; None: the task's default
    lr: float = 5e-5  # actor_rollout_ref.actor.optim.lr
    weight_decay: float = 0.0  # actor_rollout_ref.actor.optim.weight_decay
    ppo_epochs: int = 1  # actor_rollout_ref.actor.ppo_epochs
    ppo_mini_batch_size: int = 32  # actor_rollout_ref.actor.ppo_mini_batch_size, in prompts
    clip_ratio: float = 0.2  # actor_rollout_ref.actor.clip_ratio
    clip_ratio_c: float = 3.0  # actor_rollout_ref.actor.clip_ratio_c (dual-clip bound for negative advantages)
    loss_agg_mode: str = "token-mean"  # actor_rollout_ref.actor.loss_agg_mode
    entropy_coeff: float = 0.0  # actor_rollout_ref.actor.entropy_coeff
    kl_loss_coef: float = 0.0  # actor_rollout_ref.actor.kl_loss_coef (KL to the reference in the loss)
    kl_loss_type: str = "low_var_kl"  # actor_rollout_ref.actor.kl_loss_type
    grad_clip: float = 1.0  # actor_rollout_ref.actor.grad_clip
    eval_size: int = 0  # held-out problems scored greedily before and after training; 0 skips
    seed: int = 0  # trainer seed (prompt order and sampling seeds)
    out: str | None = None  # folder for metrics.jsonl and summary.json


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.rng = random.Random(cfg.seed)
        path = resolve_model(cfg.model)
        self.tok = AutoTokenizer.from_pretrained(path)
        self.policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.task = TASKS.get(cfg.task)()
        self.client = FarmClient(cfg.service_url, cfg.token)
        self.version = self.client.weights_version().version
        if self.version > 0:  # version 0 is the model folder both sides loaded; anything later, we replace
            self.push()
        self.generated_tokens = 0  # by the service for this trainer, filtered-out work included
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.out = Path(cfg.out) if cfg.out else None
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)

    def run(self) -> dict:
        summary: dict = {"config": {k: v for k, v in asdict(self.cfg).items() if k != "token"}}
        if self.cfg.eval_size:
            summary["before"] = self.evaluate()
        bar = tqdm(range(1, self.cfg.steps + 1), desc="training", unit="step", file=sys.stderr)
        for step in bar:
            start = time.perf_counter()
            batch = self.pull()
            if batch is None:  # every group was filtered out: nothing to learn from this step
                log.warning(json.dumps({"event": "empty_batch", "step": step}))
                continue
            advantages = algos.grpo_advantages(batch.rewards, batch.response_mask, batch.group_ids)
            metrics = self.update(batch, advantages)
            self.push()
            metrics.update(self.batch_metrics(batch, time.perf_counter() - start), step=step, weight_version=self.version, generated_tokens=self.generated_tokens)
            self.client.report_policy_stats(P.PolicyStats(kl=max(0.0, metrics["kl_ref"]), reward_var=batch.rewards.var(unbiased=False).item(), step=step))
            self.record(metrics)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kl=f"{metrics['kl_ref']:.4f}")
        if self.cfg.eval_size:
            summary["after"] = self.evaluate()
        summary["final_weight_version"] = self.version
        if self.out:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def render(self, p: Problem) -> str:
        """The prompt text sent to the service: through the chat template when the model has one."""
        if self.tok.chat_template:
            return self.tok.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False, add_generation_prompt=True)
        return p.prompt

    def pull(self) -> Batch:
        problems = self.task.train_batch(self.rng, math.ceil(self.cfg.train_batch_size * self.cfg.oversample))
        params = P.SamplingParams(temperature=self.cfg.temperature, top_p=self.cfg.top_p, seed=self.rng.getrandbits(31),
                                  max_new_tokens=self.cfg.max_new_tokens or self.task.max_new_tokens)
        sampler = P.SamplerSpec(name=self.cfg.sampler, params=json.loads(self.cfg.sampler_params))
        if sampler.name == "dynamic_group_filter" and len(problems) > self.cfg.train_batch_size:
            sampler.params.setdefault("target_groups", self.cfg.train_batch_size)
        req = P.RolloutRequest(prompts=[P.Prompt(text=self.render(p), ground_truth=p.answer) for p in problems], n=self.cfg.n,
                               sampling_params=params, sampler=sampler, reward=self.task.reward)
        out = self.client.rollouts(req)
        self.generated_tokens += out.filter.generated_tokens if out.filter else sum(len(s.token_ids) for g in out.groups for s in g.samples)
        groups = [g for g in out.groups if g.samples]
        if not groups:
            return None
        batch = make_batch(groups, self.pad_id)
        stale = [v for v in batch.weight_versions if v != self.version]
        if stale:
            raise RuntimeError(f"{len(stale)} samples came from weight versions {sorted(set(stale))}, expected {self.version}")
        return batch

    def update(self, batch: Batch, advantages: torch.Tensor) -> dict:
        """PPO epochs over mini-batches of whole groups; old logprobs come from the rollout (same weights)."""
        self.policy.train()
        n_groups = int(batch.group_ids.max()) + 1
        stats: dict[str, list[float]] = {}
        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(n_groups)
            for chunk in order.split(self.cfg.ppo_mini_batch_size):
                idx = torch.nonzero(torch.isin(torch.as_tensor(batch.group_ids), chunk)).squeeze(-1)
                mb, adv = batch.select(idx), advantages[idx]
                lp, entropy = response_logprobs(self.policy, mb, with_entropy=True)
                with torch.no_grad():
                    ref_lp, _ = response_logprobs(self.ref, mb)
                pg_loss, pg_metrics = algos.ppo_loss(mb.rollout_logprobs, lp, adv, mb.response_mask, self.cfg.clip_ratio, self.cfg.clip_ratio_c, self.cfg.loss_agg_mode)
                kl = algos.masked_mean(algos.kl_penalty(lp, ref_lp, self.cfg.kl_loss_type), mb.response_mask)
                ent = algos.masked_mean(entropy, mb.response_mask)
                loss = pg_loss + self.cfg.kl_loss_coef * kl - self.cfg.entropy_coeff * ent
                self.opt.zero_grad()
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.grad_clip)
                self.opt.step()
                for k, v in {"pg_loss": pg_loss.item(), "kl_ref": kl.item(), "entropy": ent.item(), "grad_norm": grad_norm.item(),
                             "pg_clipfrac": pg_metrics["actor/pg_clipfrac"], "ppo_kl": pg_metrics["actor/ppo_kl"]}.items():
                    stats.setdefault(k, []).append(v)
        self.policy.eval()
        return {k: sum(v) / len(v) for k, v in stats.items()}

    def push(self) -> None:
        """Send the new weights as the next version and check the service serves it."""
        data = save({k: v.detach().contiguous() for k, v in canonical_state_dict(self.policy).items()})
        pushed = self.client.push_weights(data, self.version + 1)
        served = self.client.weights_version().version
        if served != pushed.version:
            raise RuntimeError(f"pushed version {pushed.version} but the service serves {served}")
        self.version = served

    def batch_metrics(self, b: Batch, seconds: float) -> dict:
        tokens = int(b.response_mask.sum())
        return {"reward_mean": b.rewards.mean().item(), "reward_std": b.rewards.std().item(), "response_len": tokens / len(b),
                "step_seconds": seconds, "tokens_per_s": tokens / seconds, "samples": len(b)}

    def evaluate(self) -> dict:
        return evaluate(self.client, self.task, self.render, self.cfg.eval_size).as_dict()

    def record(self, metrics: dict) -> None:
        line = json.dumps({"event": "train_step", **{k: round(v, 5) if isinstance(v, float) else v for k, v in metrics.items()}})
        log.info(line)
        if self.out:
            with (self.out / "metrics.jsonl").open("a") as f:
                f.write(line + "\n")
