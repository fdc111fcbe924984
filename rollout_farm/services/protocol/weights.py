"""Weight pushes (upload, shared-storage path, NCCL) and the served versions."""

from __future__ import annotations

from pydantic import BaseModel, Field

from rollout_farm.services.protocol.common import Dim, InFlightPolicy, Int64, RequestModel, Text


class WeightsFromPath(RequestModel):
    """POST /v1/weights/path: load a folder of safetensors files that every replica can read."""

    path: Text = Field(..., min_length=1, description="Folder with *.safetensors files (a shared volume in a cluster).")
    version: Int64 = Field(..., ge=1, description="The new version; higher than the served one.")
    policy: InFlightPolicy = Field("finish", description="What happens to in-flight samples at the commit.")
    force: bool = Field(
        False,
        description="Push even though LoRA adapters made on the served base are resident: they are retired first "
        "(without it, such a push is a 409 naming them).",
    )
    probe: dict | None = Field(
        None,
        description="Token sequences and the logprobs the pusher computed for them with these weights: every replica "
        "scores them on the staged weights before the commit ({sequences, logprobs, tolerance}; docs/tenants.md). "
        "A `probe.json` in the folder does the same; give one or the other.",
    )


class DistributedGroup(RequestModel):
    """POST /v1/weights/distributed/init: SGLang's init_weights_update_group, on every replica."""

    master_address: Text
    master_port: int = Field(..., ge=1, le=65535)
    rank_offset: Int64 = Field(..., ge=0)
    world_size: Int64 = Field(..., ge=2)
    group_name: Text = "weight_update_group"
    backend: Text = "nccl"


class DistributedUpdate(RequestModel):
    """POST /v1/weights/distributed: SGLang's update_weights_from_distributed; the trainer broadcasts the tensors."""

    names: list[Text] = Field(..., min_length=1)
    dtypes: list[Text] = Field(..., min_length=1)
    shapes: list[list[Dim]] = Field(..., min_length=1)
    version: Int64 = Field(..., ge=1)
    group_name: Text = "weight_update_group"


class WeightsVersion(BaseModel):
    version: int = Field(..., description="The weight version every answering replica serves (the oldest of them).")
    replicas: dict[str, int] = Field(default_factory=dict, description="Version reported by each replica.")
    unreachable: list[str] = Field(
        default_factory=list,
        description="Replicas that did not answer (dead, restarting, or not yet started), each with what happened; "
        "`version` and `replicas` leave them out. Empty when every replica answered.",
    )


class WeightsPushResponse(BaseModel):
    version: int = Field(..., description="The version now served.")
    tensors: int = Field(..., description="Tensors loaded.")
    bytes: int = Field(..., description="Size of the upload.")
    seconds: float = Field(..., description="Time from upload received to every replica serving it.")
    base: int | None = Field(None, description="The version a bucketed or delta push applied to; null: a full push.")
    sent_tensors: int | None = Field(
        None, description="Tensors whose bytes the upload carried (a push with a base leaves unchanged ones out)."
    )
