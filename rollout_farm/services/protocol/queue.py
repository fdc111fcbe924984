"""The pull-mode trajectory queue: the service generates from a registered prompt source in the background;
a trainer pulls leased groups and acks them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_farm.services.protocol.adapters import AdapterRef
from rollout_farm.services.protocol.common import MAX_N, Float, Int64, Prompt, RequestModel, SamplingParams, Text
from rollout_farm.services.protocol.episodes import EpisodeLimits
from rollout_farm.services.protocol.rollouts import Group, SamplerSpec


class QueueSource(RequestModel):
    """POST /v1/queue/sources: register a prompt source; the service keeps `target_groups` groups ready from it."""

    # the model validator's rule, for the schema: not a dataset and prompts together
    model_config = ConfigDict(
        json_schema_extra={
            "not": {
                "properties": {"dataset": {"type": "string"}, "prompts": {"minItems": 1}},
                "required": ["dataset", "prompts"],
            }
        }
    )

    name: str = Field(
        ..., pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Source name: letters, digits, '_', '.', '-'."
    )
    dataset: Literal["arith", "gsm8k"] | None = Field(
        None, description="A dataset in the repo (its train split, cycled); or none, to add prompts later."
    )
    prompts: list[Prompt] = Field(
        default_factory=list, max_length=100_000, description="Prompts to start with (more: POST .../prompts)."
    )
    n: int = Field(4, ge=1, le=MAX_N, description="Samples per prompt (one group).")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    reward: Text | None = Field(None, description="Registered reward name; defaults to the dataset's reward.")
    adapter: AdapterRef | None = Field(
        None,
        description="Sample from this LoRA adapter (an exact version, or the newest resident from min_version); "
        "null: the base model. Every sample carries its policy.",
    )
    target_groups: int = Field(8, ge=1, le=4096, description="Groups kept generated ahead of the trainer.")
    seed: Int64 = Field(0, ge=0, description="Order of the dataset's prompts.")
    episodes: EpisodeLimits | None = Field(
        None,
        description="An episode source: each prompt's group is n multi-turn episodes against this environment "
        "(POST /v1/episodes), trained through each sample's loss_mask. None: single-turn rollouts.",
    )

    @model_validator(mode="after")
    def _dataset_or_prompts(self) -> "QueueSource":
        if self.dataset and self.prompts:
            raise ValueError("give a dataset or prompts, not both")
        return self


class QueuePrompts(RequestModel):
    """POST /v1/queue/sources/{name}/prompts as JSON (or send JSONL: one Prompt per line)."""

    prompts: list[Prompt] = Field(..., min_length=1, max_length=100_000)


class QueueSourceState(BaseModel):
    name: str
    dataset: str | None
    pending_prompts: int = Field(
        ..., description="Prompts not yet generated (a dataset source cycles: 0 means endless)."
    )
    ready: int = Field(..., description="Groups generated and waiting to be pulled.")
    leased: int = Field(..., description="Groups pulled and not yet acked.")
    acked: int
    redelivered: int = Field(..., description="Groups delivered again after their lease expired.")
    stale_dropped: int = Field(
        ..., description="Groups dropped for exceeding a pull's max_staleness (their prompts are generated again)."
    )
    generating: bool
    error: str | None = Field(None, description="The last generation failure, if the newest attempt failed.")
    target_groups: int | None = Field(None, description="Groups the service keeps generated ahead (the source's).")
    generation_busy_s: float = Field(
        0.0, description="Seconds the source's generation loop has spent generating, since the source was added."
    )
    generation_idle_s: float = Field(
        0.0,
        description="Seconds it had nothing it was allowed to generate: no prompt pending, or target_groups ready. "
        "Over an interval, idle / (idle + busy) of the two counters' changes is the rollout idle ratio.",
    )


class PullRequest(RequestModel):
    """POST /v1/queue/pull: lease up to max_groups groups from a source."""

    source: Text
    max_groups: int = Field(8, ge=1, le=4096)
    max_staleness: Int64 | None = Field(
        None,
        ge=0,
        description="Largest allowed gap between the current version and a group's; older groups are dropped and "
        "generated again.",
    )
    lease_s: Float = Field(300.0, gt=0, le=86400, description="Seconds until unacked groups are delivered again.")
    wait_s: Float = Field(0.0, ge=0, le=600, description="Wait up to this long for at least one group.")


class QueueItem(BaseModel):
    item_id: str = Field(
        ..., description="Unique per group; the same on redelivery, so a trainer can drop a duplicate."
    )
    prompt: Prompt
    group: Group
    weight_version: int = Field(..., description="The oldest weight version among the group's tokens.")
    deliveries: int = Field(..., description="1 on first delivery; more after lease expiries.")


class PullResponse(BaseModel):
    lease_id: str
    lease_expires_s: float = Field(
        ..., description="Seconds from now until these groups are delivered again unless acked."
    )
    current_version: int = Field(..., description="The committed weight version when pulled.")
    items: list[QueueItem]
    stale_dropped: int = Field(0, description="Groups this pull dropped as too stale.")


class AckRequest(RequestModel):
    """POST /v1/queue/ack: the groups the trainer has used. Acking twice is harmless."""

    item_ids: list[Text] = Field(..., min_length=1, max_length=100_000)


class AckResponse(BaseModel):
    acked: list[str] = Field(..., description="Newly acked.")
    already_acked: list[str] = Field(..., description="Acked before: nothing changes.")
    unknown: list[str] = Field(
        ..., description="Ids this service never delivered (a typo, or a source that was removed or added again)."
    )
