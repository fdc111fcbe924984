"""A training run: what it holds between steps, and how it starts.

The trainer owns the policy, a frozen reference, and a critic when the estimator needs values; the service
owns generation. They meet only over HTTP: trajectories come back as JSON, weights go out as safetensors. With
LoRA (actor_rollout_ref.model.lora_rank > 0) the policy is a peft model whose adapter alone trains and is pushed,
and the reference is that model with its adapter disabled (rollout_farm/trainer/lora.py).
"""

from __future__ import annotations

import logging
import random
import uuid
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
from verl.trainer.ppo import core_algos

from rollout_farm.services.client import FarmClient
from rollout_farm.services.extensions.tasks import TASKS
from rollout_farm.services.models import resolve_model
from rollout_farm.services.weights.path_pusher import PathPusher
from rollout_farm.services.weights.pusher import WeightPusher
from rollout_farm.trainer import distributed, lora
from rollout_farm.trainer.config import Config, Optim
from rollout_farm.trainer.guards.checks import Guard
from rollout_farm.trainer.outputs import checkpoint, step_metrics
from rollout_farm.trainer.sync.adapter import AdapterSync
from rollout_farm.trainer.sync.probe import PushProbe
from rollout_farm.trainer.sync.weights import push_weights

log = logging.getLogger("farm.trainer")


class TrainingRun:
    """The models and optimizers, verl's KL controller, the guard, the service client, the run's RNG (prompts and
    sampling seeds) and counters. Rank 0 alone talks to the service and writes files.

    Building one starts the run: it resumes from the newest checkpoint (trainer.resume_mode=auto), pushes its
    weights unless the service serves version 0 (the model folder both sides loaded), and saves step 0 (what a
    rollback before the first periodic checkpoint returns to). With LoRA it always pushes its adapter at start
    (v<step + 1>) and never the base; `version` is then the adapter's version, the one every staleness counts."""

    def __init__(self, cfg: Config, token: str = ""):
        self.cfg, t = cfg, cfg.trainer
        self.device = distributed.resolve_device(t.device)
        self.rank, self.world = distributed.init_from_env(self.device)
        torch.manual_seed(t.seed)
        self.rng = random.Random(t.seed)
        self._load_models(resolve_model(cfg.actor_rollout_ref.model.path))
        self.kl_ctrl = core_algos.get_kl_controller(cfg.algorithm.kl_ctrl)
        self.mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size  # the guard may raise it
        self.guard = Guard(cfg.guards, self.mini_batch_size)
        if t.metrics_port and self.rank == 0:
            step_metrics.serve(t.metrics_port)
        self.task = TASKS.get(t.task)()
        self.client = FarmClient(t.service_url, token)
        # one pusher for the run: its last push is the base of the next (bucketed, delta); by path with push_dir
        self.pusher = PathPusher(self.client, t.push_dir) if t.push_dir else WeightPusher(self.client, t.weight_sync)
        self.generated_tokens = 0  # by the service for this trainer, filtered-out work included
        self.leased: list[str] = []  # queue items of the current step, acked once its checkpoint is written
        self.run_id = uuid.uuid4().hex[:12]  # with `batches`, names this run's prompt batches in the queue
        self.batches = 0  # prompt batches fed to the queue; a resume goes back to the checkpoint's, a rollback not
        self.redelivered = 0  # queue groups that came back from an earlier (killed) trainer's lease
        self.pulls = 0  # steps' rollouts pulled; with async training the queue is fed this + staleness_threshold
        self.last_good = (
            None  # what a rollback returns to (rollout_farm/trainer/guards/last_good.py), kept after each good step
        )
        self.pull_stats: dict = {}  # the last pull's wait and drops (rollout_farm/trainer/sync/rollouts.py)
        self.queue_clock: tuple[float, float] | None = None  # the queue source's generation busy/idle s, last pull
        self.out = Path(t.default_local_dir) if t.default_local_dir else None
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
        self.step = 0
        self.base_version = self.client.weights_version().version if self.rank == 0 else 0
        self.version = 0 if cfg.lora else self.base_version  # with LoRA, the adapter's: set by the first push
        self.adapter = None  # with LoRA, on rank 0: the adapter's pushes and the digests samples must carry
        self.report_stats = True  # with LoRA, False once the farm refused the token for POST /v1/policy_stats
        # each push's probe: the policy's logprobs of a few fixed sequences, scored by every replica before the commit
        self.probe = PushProbe.of_run(t, self.tok, self.policy) if self.rank == 0 else None
        if cfg.lora and self.rank == 0:
            base = lora.base_tensors(self.policy)
            push_dir = t.adapter_push_dir or t.push_dir  # the adapter's versions by path, in <folder>/<name>/v<N>/
            self.adapter = AdapterSync(self.client, cfg.adapter_name, base, push_dir, self.probe)
        self._start()

    def _load_models(self, path: Path) -> None:
        self.tok = AutoTokenizer.from_pretrained(path)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        if self.cfg.lora:  # the adapter trains; the reference is the base: the same model, its adapter disabled
            self.policy = lora.wrap(self.policy, self.cfg.actor_rollout_ref.model)
            self.ref = lora.Reference(self.policy)
        else:
            self.ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
            self.ref.eval().requires_grad_(False)
        self.opt = {"actor": _adamw(self.policy, self.cfg.actor_rollout_ref.actor.optim)}
        self.critic = None
        if self.cfg.critic_enabled:
            critic = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
            self.critic = critic.to(self.device)
            self.opt["critic"] = _adamw(self.critic, self.cfg.critic.optim)

    def _start(self) -> None:
        resumed = checkpoint.latest(self.out) if self.out and self.cfg.trainer.resume_mode == "auto" else None
        distributed.barrier()  # every rank looks before rank 0 saves step 0 below, or a late rank would resume from it
        if resumed:
            state = self.restore(resumed)
            self.run_id, self.batches = state.get("run_id", self.run_id), state.get("batches", 0)
            self.pulls = state.get("pulls", self.step)
            if state.get("leased") and self.rank == 0:  # trained into this checkpoint; killed before their ack
                self.client.queue_ack(state["leased"])
            log.info("resumed", extra={"checkpoint": str(resumed), "step": self.step, "rank": self.rank})
        if resumed or self.version > 0 or self.cfg.lora:  # version 0 is the model folder both sides loaded
            self.push()
        if self.out and not resumed:
            if self.rank == 0:
                (self.out / "metrics.jsonl").unlink(missing_ok=True)
            self.save()  # step 0: what a rollback before the first periodic checkpoint returns to

    def push(self) -> None:
        """Send the policy as the service's next version (rank 0; the other ranks hold the same weights). With
        async training, samples in flight go on with the new weights ("partial"), or are cut and run again on them
        ("abort"); else the push waits for them to end on the old weights ("finish"). Each push carries the policy's
        probe (trainer.push_probe_sequences); the farm refusing it stops the run (ProbeRefused)."""
        if self.rank == 0 and self.adapter is not None:  # only the adapter, as <name>@v<step + 1> or above
            self.version = self.adapter.push(self.policy, self.step + 1)
        elif self.rank == 0:
            a = self.cfg.async_training
            policy = ("partial" if a.partial_rollout else "abort") if a.enabled else "finish"
            self.version = push_weights(self.pusher, self.policy, policy, self.probe)

    def save(self) -> None:
        """Checkpoint this step: rank 0 writes it, and every rank waits until it is written."""
        if self.rank == 0:
            state = {"kl_coef": self.kl_ctrl.value, "mini_batch_size": self.mini_batch_size}
            state |= {"generated_tokens": self.generated_tokens, "config": self.cfg.model_dump()}
            state |= {"run_id": self.run_id, "batches": self.batches, "pulls": self.pulls, "leased": self.leased}
            checkpoint.save(self.out, self.step, self.policy, self.opt, state, critic=self.critic, trainer_rng=self.rng)
        distributed.barrier()

    def restore(self, path: Path, rngs: bool = True) -> dict:
        """Load a checkpoint into this run; with rngs=False the RNGs keep their current state. Returns its state."""
        rng = self.rng if rngs else None
        state = checkpoint.load(path, self.policy, self.opt, critic=self.critic, trainer_rng=rng, rngs=rngs)
        self.step, self.kl_ctrl.value = state["step"], state["kl_coef"]
        self.mini_batch_size, self.generated_tokens = state["mini_batch_size"], state["generated_tokens"]
        return state


def _adamw(model: torch.nn.Module, optim: Optim) -> torch.optim.AdamW:
    """AdamW over the parameters that train (with LoRA, the adapter's alone)."""
    return torch.optim.AdamW(lora.trainable(model), lr=optim.lr, weight_decay=optim.weight_decay)
