"""Trainer configuration with verl's key names: a YAML file plus dotted overrides.

    farm train --config rollout_farm/trainer/presets/design.yaml actor_rollout_ref.rollout.n=16
    algorithm.kl_ctrl.target_kl=0.02

Only the keys this trainer uses exist; an unknown key, a wrong type or an out-of-range value is an error
that names the dotted key and says what to put there. Values of overrides are parsed as YAML
(`x=0.1`, `x=true`, `x=[1,2]`, `x=null`).

The model and learning sections (actor_rollout_ref, critic, algorithm) are in rollout_farm/trainer/config_sections.py
and exported from here; the run's sections (data, trainer, async_training), the whole Config and its loading are here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import AliasChoices, Field, ValidationError, model_validator

from rollout_farm.services.protocol.adapters import ADAPTER_NAME
from rollout_farm.trainer.config_sections import (
    ActorConfig,
    ActorRolloutRef,
    Algorithm,
    CriticConfig,
    KLCtrl,
    ModelConfig,
    Optim,
    RolloutConfig,
    RolloutCorrection,
    _Strict,
)
from rollout_farm.trainer.guards.checks import GuardConfig
from rollout_farm.trainer.minibatches import updates_per_epoch

__all__ = [
    "PRESETS",
    "ActorConfig",
    "ActorRolloutRef",
    "Algorithm",
    "AsyncTraining",
    "Config",
    "ConfigError",
    "CriticConfig",
    "Data",
    "KLCtrl",
    "ModelConfig",
    "NEEDS_CRITIC",
    "Optim",
    "RolloutConfig",
    "RolloutCorrection",
    "TrainerConfig",
    "load",
]
PRESETS = Path(__file__).parent / "presets"


class Data(_Strict):
    train_batch_size: int = Field(32, ge=1, le=512, description="prompts per step")
    max_response_length: int | None = Field(None, ge=1, le=4096, description="None: the task's default")
    oversample: float = Field(
        1.0, ge=1, le=16, description="prompts sent per step / train_batch_size (dynamic_group_filter)"
    )
    env: str | None = Field(
        None,
        description="an environment (calculator, or pkg.module:Class on the service): each group is n multi-turn "
        "episodes against it, trained on their sampled tokens only; None: single-turn rollouts",
    )
    env_params: dict = Field(default_factory=dict, description="the environment's params")
    max_turns: int = Field(4, ge=1, le=64, description="sampled turns per episode at most (with env)")


class TrainerConfig(_Strict):
    total_training_steps: int = Field(40, ge=1)
    seed: int = 0
    task: str = "arith"
    reward: str | None = Field(None, description="the service's reward function; None: the task's (gsm8k)")
    service_url: str = "http://127.0.0.1:8000"
    eval_size: int = Field(0, ge=0, description="held-out problems scored greedily before and after; 0 skips")
    test_freq: int = Field(
        -1, description="also score them every this many steps (val_accuracy in metrics.jsonl); -1: never"
    )
    default_local_dir: str | None = Field(None, description="metrics.jsonl, summary.json and checkpoints go here")
    save_freq: int = Field(-1, description="checkpoint every this many steps; -1: only at the end (and step 0)")
    rollout_source: Literal["request", "queue"] = Field(
        "request",
        description="request: POST /v1/rollouts each step; queue: the service's "
        "trajectory queue (pull, ack after the step): a restarted trainer gets its unacked groups again",
    )
    queue_source: str | None = Field(None, description="queue source name; default farm-trainer-<task>-<seed>")
    queue_lease_s: float = Field(
        120.0, gt=0, le=86400, description="seconds until pulled-but-unacked groups are delivered again"
    )
    queue_max_staleness: int = Field(
        0,
        ge=0,
        description="drop (and regenerate) groups this many versions behind; above 0 needs old_logprobs=recompute",
    )
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="serve the trainer's Prometheus metrics on this port"
    )
    weight_sync: Literal["full", "bucketed", "delta"] = Field(
        "full",
        description="how each step's weights go to the service: full (every tensor; the fastest on one machine), "
        "bucketed (only the tensors that changed) or delta (changed tensors as compressed XOR: the fewest bytes, "
        "for a slow link); both fall back to full when a replica is not on the version they diff against",
    )
    push_dir: str | None = Field(
        None,
        description="a folder the farm reads at the same path (shared storage: one machine, compose's or the Helm "
        "chart's volume; inside the farm's FARM_WEIGHTS_DIR when that is set): each step's weights are written there "
        "once, as v<N>/model.safetensors, and pushed by path (POST /v1/weights/path), the newest 3 versions kept; "
        "with LoRA, the adapter goes there by path (unless trainer.adapter_push_dir names another folder). None: each "
        "step's weights are uploaded over HTTP (trainer.weight_sync)",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="where the trainer's models live: auto (a GPU if there is "
        "one; under torchrun each rank takes cuda:LOCAL_RANK), cpu, cuda or cuda:i",
    )
    resume_mode: Literal["auto", "disable"] = Field(
        "auto", description="auto: continue from the newest checkpoint in default_local_dir"
    )
    experiment_name: str | None = Field(
        None, description="the run's name (verl's key); with LoRA, the adapter's name unless trainer.adapter is set"
    )
    adapter: str | None = Field(
        None,
        pattern=ADAPTER_NAME,
        description="with LoRA: the adapter's name at the farm (`farm train --adapter NAME`); None: "
        "trainer.experiment_name with other characters than letters, digits, '.', '_' and '-' replaced, else "
        "farm-<task>-<seed>",
    )
    adapter_push_dir: str | None = Field(
        None,
        description="with LoRA: a folder every engine replica can read; each version is written to "
        "<folder>/<adapter>/v<N>/ and pushed by path (no upload). None: each version is uploaded",
    )
    push_probe_sequences: int = Field(
        4,
        ge=0,
        le=16,
        description="each push (weights or adapter) carries a probe: the policy's float32 logprobs of this many token "
        "sequences (drawn once from trainer.seed over the vocabulary), which every farm replica scores on the staged "
        "policy before the commit; a refusal stops the run. 0: push without a probe",
    )
    push_probe_tokens: int = Field(16, ge=2, le=256, description="tokens per probe sequence")
    push_probe_tolerance: float = Field(
        1e-3,
        gt=0,
        le=10,
        description="the largest logprob difference a replica may show on the probe: float32 agrees to ~1e-5; a farm "
        "serving the base in bfloat16 (LoRA training) needs ~0.1",
    )


class AsyncTraining(_Strict):
    """verl's async_training keys (its fully-async trainer), counted in whole weight versions here."""

    staleness_threshold: int = Field(
        0,
        ge=0,
        le=64,
        validation_alias=AliasChoices("staleness_threshold", "max_head_offpolicyness"),
        description="0: synchronous (each step's prompts are fed when it starts). s > 0: the trainer keeps s steps "
        "of prompts fed ahead to its queue source, so the service generates them while it trains, and no sample "
        "whose oldest token is more than s versions behind the trainer's reaches it (AReaL's "
        "max_head_offpolicyness, accepted as an alias). Needs trainer.rollout_source=queue",
    )
    partial_rollout: bool = Field(
        True,
        description="with staleness_threshold > 0: true pushes weights with the in-flight policy 'partial' (samples "
        "in flight go on with the new weights: one sample may span versions); false pushes with 'abort' (they are "
        "cut and run again on the new weights)",
    )

    @property
    def enabled(self) -> bool:
        return self.staleness_threshold > 0


class Config(_Strict):
    data: Data = Field(default_factory=Data)
    actor_rollout_ref: ActorRolloutRef = Field(default_factory=ActorRolloutRef)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    algorithm: Algorithm = Field(default_factory=Algorithm)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    guards: GuardConfig = Field(default_factory=GuardConfig)
    async_training: AsyncTraining = Field(default_factory=AsyncTraining)

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        from rollout_farm.trainer.algorithms import stale_samples
        from rollout_farm.trainer.algorithms.estimators import ESTIMATORS

        estimator = self.algorithm.adv_estimator
        if estimator not in ESTIMATORS.names():
            raise ValueError(
                f"algorithm.adv_estimator: unknown {estimator!r}; use one of {', '.join(ESTIMATORS.names())}"
            )
        if self.trainer.queue_max_staleness > 0 and self.actor_rollout_ref.actor.old_logprobs == "rollout":
            raise ValueError(
                "trainer.queue_max_staleness: above 0 the queue delivers samples from older weights; "
                "set actor_rollout_ref.actor.old_logprobs=recompute (or the staleness to 0)"
            )
        stale_samples.check(self)
        if self.trainer.push_dir is not None and self.trainer.weight_sync != "full":
            raise ValueError(
                f"trainer.weight_sync: {self.trainer.weight_sync} diffs HTTP uploads; with trainer.push_dir each step "
                "is written whole and pushed by path: leave weight_sync full, or drop push_dir to upload"
            )
        g, groups = self.guards, self.data.train_batch_size
        mini = self.actor_rollout_ref.actor.ppo_mini_batch_size
        if g.enable and updates_per_epoch(groups, g.raised_mini_batch_size) >= updates_per_epoch(groups, mini):
            raise ValueError(
                f"guards.raised_mini_batch_size: raising ppo_mini_batch_size from {mini} to "
                f"{g.raised_mini_batch_size} groups leaves {updates_per_epoch(groups, mini)} optimizer step(s) per "
                f"epoch over data.train_batch_size={groups} groups, so the guard would change nothing: make "
                "ppo_mini_batch_size smaller than train_batch_size and the raised size bigger than it (both count "
                "groups: rollout.n samples each)"
            )
        micro = self.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
        samples = mini * self.actor_rollout_ref.rollout.n
        if g.variance_statistic == "grad_noise_scale" and (micro is None or micro >= samples):
            raise ValueError(
                f"guards.variance_statistic: grad_noise_scale compares micro-batch gradients with the mini-batch's, "
                f"so set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu below the {samples} samples of a "
                f"mini-batch ({mini} groups x {self.actor_rollout_ref.rollout.n}), e.g. {max(1, samples // 4)}"
            )
        if self.critic.enable is False and estimator in NEEDS_CRITIC:
            raise ValueError(f"critic.enable: {estimator} needs the critic's values; set it true (or leave it unset)")
        self._lora_consistent()
        return self

    def _lora_consistent(self) -> None:
        t = self.trainer
        if not self.lora:
            for key, value in (("adapter", t.adapter), ("adapter_push_dir", t.adapter_push_dir)):
                if value is not None:
                    raise ValueError(
                        f"trainer.{key}: only LoRA training pushes an adapter; set actor_rollout_ref.model.lora_rank "
                        "above 0 (e.g. 8), or drop the key"
                    )
            return
        if t.weight_sync != "full":
            raise ValueError(
                f"trainer.weight_sync: {t.weight_sync} diffs full weight pushes; LoRA training pushes only the "
                "adapter, whole, each step: leave it full"
            )
        if self.data.env is not None:
            raise ValueError(
                "data.env: LoRA training checks every sample's policy digest, and episodes' samples carry none yet; "
                "train on single-turn rollouts (data.env=null) or the whole model (lora_rank=0)"
            )

    @property
    def lora(self) -> bool:
        """Whether the actor trains a LoRA adapter (actor_rollout_ref.model.lora_rank > 0)."""
        return self.actor_rollout_ref.model.lora_rank > 0

    @property
    def adapter_name(self) -> str:
        """The adapter's name at the farm: trainer.adapter, else trainer.experiment_name made a valid name (letters,
        digits, '.', '_', '-'; at most 64, starting with a letter or digit), else farm-<task>-<seed>."""
        t = self.trainer
        if t.adapter:
            return t.adapter
        named = re.sub(r"[^A-Za-z0-9._-]+", "-", t.experiment_name or "").lstrip("._-")[:64]
        return named or re.sub(r"[^A-Za-z0-9._-]+", "-", f"farm-{t.task}-{t.seed}")[:64]

    @property
    def critic_enabled(self) -> bool:
        return self.critic.enable if self.critic.enable is not None else self.algorithm.adv_estimator in NEEDS_CRITIC


NEEDS_CRITIC = {"gae", "adaptive_gae", "control_variate"}


class ConfigError(ValueError):
    """A configuration problem, with the dotted key and the fix."""


def load(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """The YAML file (or the defaults), then each `dotted.key=value` override, validated."""
    tree = yaml.safe_load(Path(path).read_text()) if path else {}
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections (data, actor_rollout_ref, critic, algorithm, trainer)"
        )
    try:
        merged = OmegaConf.create(tree)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {e}") from None
    for item in overrides:
        _override(merged, item)
    return _validate(OmegaConf.to_container(merged))


def _override(tree: DictConfig, item: str) -> None:
    """Set one `dotted.key=value`, the value parsed as YAML. It replaces what was there (a mapping too, not merged)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r}: write dotted.key=value, e.g. actor_rollout_ref.rollout.n=16")
    section = key.rpartition(".")[0]
    if section and not isinstance(OmegaConf.select(tree, section, default={}), (DictConfig, dict)):
        raise ConfigError(f"{key}: {section} is a value, not a section")
    try:
        OmegaConf.update(tree, key, yaml.safe_load(raw), merge=False)
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from None


def _validate(tree: dict) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"])
            hint = ""
            if err["type"] == "extra_forbidden":
                hint = " (not a key this trainer has: check the spelling against rollout_farm/trainer/config.py)"
            lines.append(f"{key or 'config'}: {err['msg']}{hint}")
        raise ConfigError("invalid trainer config:\n  " + "\n  ".join(lines)) from None
