"""Episodes run in the farm: an environment plug-in, a prompt per group, n episodes each, multi-turn with tools.

Every episode is a session (rollout_farm/services/episodes/), so its tokens follow the same rule, tokens in and tokens
out, and its segments have the trajectory's shape.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from rollout_farm.services.protocol.adapters import AdapterRef
from rollout_farm.services.protocol.common import (
    MAX_N,
    MAX_PROMPTS,
    Float,
    Int64,
    Prompt,
    RequestModel,
    SamplingParams,
    Text,
)
from rollout_farm.services.protocol.rollouts import SamplerSpec
from rollout_farm.services.protocol.sessions import MAX_SESSION_TTL_S, SegmentOut

MAX_TURNS = 64
StopReason = Literal["done", "max_turns", "max_tokens", "context_overflow", "env_error"]


class EnvSpec(RequestModel):
    name: Text = Field(..., description="A registered environment (GET /v1/environments), or pkg.module:Class.")
    params: dict = Field(default_factory=dict, description="The environment's own params; checked by it.")


class EpisodeLimits(RequestModel):
    """What an episode may take: an environment's, whether requested (POST /v1/episodes) or a queue source's."""

    env: EnvSpec
    max_turns: int = Field(8, ge=1, le=MAX_TURNS, description="Sampled turns per episode at most.")
    max_total_tokens: int | None = Field(
        None, ge=1, description="Sampled tokens per episode at most (then stop_reason max_tokens); None: no bound."
    )
    tool_timeout_s: Float = Field(
        30.0, gt=0, le=600, description="A reset or step that takes longer gets an error observation, not a hang."
    )


class EpisodeRequest(EpisodeLimits):
    """POST /v1/episodes."""

    prompts: list[Prompt] = Field(..., min_length=1, max_length=MAX_PROMPTS, description="One group each.")
    n: int = Field(1, ge=1, le=MAX_N, description="Episodes per prompt (a GRPO group).")
    sampling_params: SamplingParams = Field(
        default_factory=SamplingParams, description="Every turn's; max_new_tokens bounds one turn."
    )
    sampler: SamplerSpec = Field(default_factory=SamplerSpec, description="How each turn is drawn (n=1 samplers).")
    min_weight_version: Int64 = Field(0, ge=0, description="Every turn runs on this weight version or later.")
    adapter: AdapterRef | None = Field(
        None,
        description="Sample from this LoRA adapter (an exact version, or the newest resident from min_version); "
        "null: the base model. Every turn is checked against the version's digest; each turn of the episode's "
        "segments records the policy that drew it (`policies`).",
    )
    ttl_s: Float = Field(
        3600.0, gt=0, le=MAX_SESSION_TTL_S, description="Each episode's session stays readable this long."
    )
    stream: bool = Field(False, description="NDJSON: an EpisodeGroup per line as each finishes, then an end line.")


class EpisodeOut(BaseModel):
    session_id: str = Field(..., description="Its session: GET /v1/sessions/{id}/trajectory reads it again.")
    segments: list[SegmentOut] = Field(..., description="The episode's tokens (one segment: episodes never fork).")
    reward: float = Field(..., description="The sum of the steps' rewards.")
    turn_rewards: list[float]
    turns: int
    tool_calls: int
    malformed_tool_calls: int
    stop_reason: StopReason
    error: str | None = Field(None, description="env_error: what the environment raised.")
    weight_version: int = Field(..., description="The oldest weight version of its sampled tokens (-1: none).")


class EpisodeGroup(BaseModel):
    prompt_index: int
    episodes: list[EpisodeOut]
    reward_mean: float
    reward_std: float = Field(..., description="Population std of the episodes' rewards.")
    zero_variance: bool


class EpisodeResponse(BaseModel):
    groups: list[EpisodeGroup] = Field(..., description="In the order of the prompts.")


class EpisodeStreamEnd(BaseModel):
    done: Literal[True] = True
    groups: int
    error: str | None = None
    status: int | None = None


class EnvironmentList(BaseModel):
    environments: dict[str, str] = Field(..., description="Name -> what it is.")
    params: dict[str, dict] = Field(default_factory=dict, description="Name -> the JSON Schema of its env.params.")
