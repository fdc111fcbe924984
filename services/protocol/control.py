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


class ReplicaState(BaseModel):
    replica: str = Field(..., description="Ray Serve replica id.")
    weight_version: int
    paused: bool
    busy: bool = Field(False, description="A generate call is running.")
    generated_tokens: int = Field(0, description="Tokens this replica has generated since it started.")


class ControlResponse(BaseModel):
    """POST /v1/pause, /v1/resume, /v1/abort: the state of every replica after the action."""

    action: Literal["pause", "resume", "abort"]
    replicas: list[ReplicaState]


class Readiness(BaseModel):
    """GET /readyz: ready when no replica is paused and all serve one weight version."""

    ready: bool
    replicas: list[ReplicaState]
