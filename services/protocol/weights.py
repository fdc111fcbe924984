"""Weight pushes (upload, shared-storage path, NCCL) and the served versions."""

from __future__ import annotations

from pydantic import BaseModel, Field

from services.protocol.common import InFlightPolicy


class WeightsFromPath(BaseModel):
    """POST /v1/weights/path: load a folder of safetensors files that every replica can read."""

    path: str = Field(..., min_length=1, description="Folder with *.safetensors files (a shared volume in a cluster).")
    version: int = Field(..., ge=1, description="The new version; higher than the served one.")
    policy: InFlightPolicy = Field("finish", description="What happens to in-flight samples at the commit.")


class DistributedGroup(BaseModel):
    """POST /v1/weights/distributed/init: SGLang's init_weights_update_group, on every replica."""

    master_address: str
    master_port: int = Field(..., ge=1, le=65535)
    rank_offset: int = Field(..., ge=0)
    world_size: int = Field(..., ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DistributedUpdate(BaseModel):
    """POST /v1/weights/distributed: SGLang's update_weights_from_distributed; the trainer broadcasts the tensors."""

    names: list[str] = Field(..., min_length=1)
    dtypes: list[str] = Field(..., min_length=1)
    shapes: list[list[int]] = Field(..., min_length=1)
    version: int = Field(..., ge=1)
    group_name: str = "weight_update_group"


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
