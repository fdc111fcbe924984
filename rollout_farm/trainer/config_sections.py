"""The trainer configuration's model and learning sections, with verl's key names: actor_rollout_ref (the model,
its rollouts, the actor's update), critic and algorithm (advantages, KL, rollout correction).

rollout_farm/trainer/config.py holds the run's sections (data, trainer, async_training), the whole `Config` with the
checks across sections, and its loading; it exports these sections too.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Optim(_Strict):
    lr: float = Field(5e-5, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0)


class ModelConfig(_Strict):
    path: str = Field("arith-tiny", description="HF model folder, or 'arith-tiny'; must be what the service serves")
    lora_rank: int = Field(
        0,
        ge=0,
        le=1024,
        description="above 0: train a peft LoRA adapter of this rank on the frozen base and push only the adapter "
        "(docs/trainer.md, Training a LoRA adapter); 0: train the whole model (verl's key and default)",
    )
    lora_alpha: float = Field(
        16, gt=0, description="LoRA's scaling numerator: the adapter adds lora_alpha / lora_rank * B A x (verl's 16)"
    )
    target_modules: str | list[str] = Field(
        "all-linear",
        description="the layers that get an adapter: all-linear (every linear layer but the output head, verl's "
        "default) or a list of module names, e.g. [q_proj, v_proj]",
    )

    @field_validator("target_modules")
    @classmethod
    def _modules(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, str) and v != "all-linear":
            raise ValueError(f"{v!r}: write all-linear, or a list of module names such as [q_proj, v_proj]")
        if isinstance(v, list):
            if not v:
                raise ValueError("an empty list adapts nothing: name modules, e.g. [q_proj, v_proj], or all-linear")
            if bad := [m for m in v if not re.fullmatch(r"[A-Za-z0-9_.]+", m)]:
                raise ValueError(f"{bad} are not module names (letters, digits, '_' and '.'), e.g. q_proj")
        return v


class RolloutConfig(_Strict):
    n: int = Field(8, ge=1, le=64, description="samples per prompt")
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    sampler: str = Field("plain", description="the service's sampler (GET /v1/samplers)")
    sampler_params: dict = Field(default_factory=dict)


class ActorConfig(_Strict):
    optim: Optim = Field(default_factory=Optim)
    ppo_epochs: int = Field(1, ge=1)
    ppo_mini_batch_size: int = Field(
        32, ge=1, description="in prompts (groups), as verl; above data.train_batch_size it is one mini-batch"
    )
    ppo_micro_batch_size_per_gpu: int | None = Field(
        None,
        ge=1,
        description="samples per forward/backward pass; the gradients of a mini-batch's "
        "micro-batches add up to one optimizer step. Also sizes the no-grad passes (reference, "
        "recomputed old logprobs). None: a process's whole share of the mini-batch at once",
    )
    clip_ratio: float = Field(0.2, gt=0, lt=1)
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip bound for negative advantages; must exceed 1")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    loss_scale_factor: int | None = Field(
        None, ge=1, description="seq-mean-token-sum-norm's constant divisor (verl's); None: the response length limit"
    )
    entropy_coeff: float = Field(0.0, ge=0)
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"
    grad_clip: float = Field(1.0, gt=0)
    old_logprobs: Literal["rollout", "recompute"] = Field(
        "recompute",
        description="recompute: a forward pass of the trainer's policy gives the PPO ratio's old logprobs, and "
        "algorithm.rollout_correction weights what remains against the distribution that sampled (verl's decoupled "
        "mode); rollout: the ratio is taken against the distribution that sampled (verl's bypass mode: no separate "
        "importance weights)",
    )
    logits_temperature: Literal["sampled", "none"] = Field(
        "sampled",
        description="sampled: the policy's logits are divided by the temperature each sample was drawn at, for "
        "the ratio, the reference and the KL, as verl does; none: raw logits (the update on tempered samples then "
        "optimises the sampler, not the policy)",
    )


class ActorRolloutRef(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)


class CriticConfig(_Strict):
    enable: bool | None = Field(
        None, description="None: on when the estimator needs values (gae, adaptive_gae, control_variate)"
    )
    optim: Optim = Field(default_factory=lambda: Optim(lr=1e-5, weight_decay=0.01))
    cliprange_value: float = Field(0.5, gt=0)
    ppo_micro_batch_size_per_gpu: int | None = Field(
        None, ge=1, description="samples per critic forward/backward pass; None: the actor's"
    )


class KLCtrl(_Strict):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    horizon: int = Field(10000, ge=1)
    target_kl: float = Field(0.1, gt=0)


class RolloutCorrection(_Strict):
    """verl's algorithm.rollout_correction keys (rollout_farm/trainer/algorithms/rollout_correction.py says what each
    does)."""

    rollout_is: Literal["token", "sequence"] | None = Field(
        "token", description="importance weights per token, per sequence (their product), or none"
    )
    rollout_is_threshold: float | str = Field(
        2.0,
        description="a number: cap the weights there (truncated IS); 'lower_upper' (e.g. '0.5_5.0'): zero "
        "the weights outside (masked IS)",
    )
    rollout_is_batch_normalize: bool = Field(False, description="scale the weights to mean 1 over the batch")
    rollout_rs: str | None = Field(
        None, description="rejection: comma-separated verl options, e.g. token_k1 or seq_mean_k3; null: none"
    )
    rollout_rs_threshold: float | str | None = Field(None, description="rollout_rs's bound(s); required with it")
    # set when stale samples get the sequence ratio by default (rollout_farm/trainer/algorithms/stale_samples.py), not
    # by the config's choice: the run then refuses stale samples drawn with truncation. Not a key.
    _stale_default: bool = PrivateAttr(False)

    @model_validator(mode="after")
    def _verl_accepts(self) -> "RolloutCorrection":
        from verl.trainer.ppo import rollout_corr_helper as h

        try:
            h._parse_rollout_is_threshold(self.rollout_is_threshold)
        except (ValueError, TypeError) as e:
            raise ValueError(f"rollout_is_threshold: {e}") from None
        if self.rollout_rs is not None:
            unknown = {o.strip() for o in self.rollout_rs.split(",")} - h.SUPPORTED_ROLLOUT_RS_OPTIONS
            if unknown:
                options = ", ".join(sorted(h.SUPPORTED_ROLLOUT_RS_OPTIONS))
                raise ValueError(f"rollout_rs: unknown {', '.join(sorted(unknown))}; use some of {options}")
            if self.rollout_rs_threshold is None:
                raise ValueError("rollout_rs_threshold: required with rollout_rs (e.g. 2.0, or 0.5_2.0 for k1)")
        return self


class Algorithm(_Strict):
    adv_estimator: str = Field(
        "grpo",
        description="gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, adaptive_gae, control_variate",
    )
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "kl"
    kl_ctrl: KLCtrl = Field(default_factory=KLCtrl)
    kl_temperature: float | None = Field(
        1.0,
        gt=0,
        description="the one temperature at which the trainer reads the KL to the reference that the adaptive "
        "controller, the guards and the samplers' policy stats use (kl_ref, kl_ref_before); the reading at each "
        "sample's own temperature is logged beside it (kl_ref_sampled). null: read at each sample's temperature",
    )
    variance_threshold: float = Field(
        0.2, gt=0, description="adaptive_gae: the reward variance at which lambda is 0.95"
    )
    long_response_length: int | None = Field(
        512, ge=1, description="adaptive_gae: lambda 0.98 when the batch's mean response length reaches this"
    )
    rollout_correction: RolloutCorrection = Field(default_factory=lambda: RolloutCorrection())
