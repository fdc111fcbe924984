"""Health, readiness and the control of every replica."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Health(BaseModel):
    status: Literal["ok", "paused"] = Field(
        ..., description="'paused' while sampling is paused; nothing is generated then."
    )
    weight_version: int
    generated_token_id: int | None = Field(
        None, description="The token the engine sampled (temperature 1) to prove it works."
    )
    replica: str | None = Field(None, description="The replica that answered (GET /healthz: the first healthy one).")
    unreachable: list[str] = Field(
        default_factory=list,
        description="Replicas that did not answer (dead, restarting, or not yet started): the service stays alive "
        "while another replica samples.",
    )


class BatchSizes(BaseModel):
    """A histogram over the engine's decode steps (rollout_farm/services/engine/stats.py)."""

    bounds: list[int] = Field(default_factory=list, description="Upper bounds (le) of the buckets.")
    counts: list[int] = Field(
        default_factory=list, description="Steps per bucket, not cumulative: len(bounds) + 1, the last above them."
    )
    sum: float = 0.0
    max: int = Field(0, description="The largest value observed.")


class DraftCounts(BaseModel):
    """Speculative decoding's drafted tokens verified, and those accepted (acceptance rate: accepted / drafted)."""

    drafted: int = 0
    accepted: int = 0


class ReplicaState(BaseModel):
    replica: str = Field(..., description="Ray Serve replica id.")
    weight_version: int
    paused: bool
    busy: bool = Field(False, description="A generate call is running.")
    generated_tokens: int = Field(0, description="Tokens this replica has generated since it started.")
    rollouts_running: int = Field(0, description="Rollout calls running (FARM_ENGINE_MAX_ONGOING_REQUESTS at most).")
    rollouts_waiting: int = Field(0, description="Rollout calls waiting for one of those slots.")
    weights_lost: str | None = Field(
        None, description="Why the committed weight version cannot be loaded (the replica is then not ready)."
    )
    busy_seconds: float = Field(
        0.0, description="Seconds the engine had at least one sample generating, since it started (idle: the rest)."
    )
    decode_steps: int = Field(0, description="Decode steps the engine has run (torch and bench engines).")
    batch_rows: BatchSizes = Field(default_factory=BatchSizes, description="Samples in the batch, per decode step.")
    batch_calls: BatchSizes = Field(
        default_factory=BatchSizes, description="Generate calls sharing the batch, per decode step."
    )
    prefill_tokens: int = Field(
        0, description="Prompt tokens fed through the model since start (torch and SGLang engines)."
    )
    session_cache_tokens: int = Field(
        0,
        description="Prompt tokens a cache saved from the prefill since start: a session's KV cache (torch), any "
        "radix-cache prefix hit (SGLang).",
    )
    prefill_shared_tokens: int = Field(
        0,
        description="Prompt tokens the group cache saved from the prefill since start (torch): a prompt fed once for "
        "all the rows that share it, or found in the prompt cache (FARM_ENGINE_PROMPT_CACHE_BYTES).",
    )
    draft_tokens: int = Field(
        0, description="Drafted tokens verified since start (torch, FARM_ENGINE_SPECULATIVE_TOKENS > 0)."
    )
    draft_accepted_tokens: int = Field(
        0, description="Drafted tokens accepted since start: the acceptance rate is this / draft_tokens."
    )
    drafts_by_sampler: dict[str, DraftCounts] = Field(
        default_factory=dict, description="The drafted and accepted tokens of rollouts, per sampler, since start."
    )
    adapter_bytes: int = Field(
        0, description="Bytes of LoRA adapter versions loaded now (FARM_ADAPTER_BYTES_PER_REPLICA at most)."
    )
    adapter_evictions: int = Field(
        0, description="Adapter versions unloaded since start to make room (least recently used, none in use)."
    )


class ControlResponse(BaseModel):
    """POST /v1/pause, /v1/resume, /v1/abort: the state of every replica after the action."""

    action: Literal["pause", "resume", "abort"]
    replicas: list[ReplicaState]


class Readiness(BaseModel):
    """GET /readyz: ready when no replica is paused and all serve one weight version."""

    ready: bool
    replicas: list[ReplicaState]
