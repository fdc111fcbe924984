"""Weight pushes (upload, path, NCCL) and the served versions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Header, Query, Request

from rollout_farm.services import protocol as P
from rollout_farm.services.api.deps import ingress
from rollout_farm.services.api.errors import refusal_logged

PUSH_ERRORS = {code: {"model": P.ErrorResponse} for code in (409, 413, 422, 501)}
NCCL_ERRORS = {code: {"model": P.ErrorResponse} for code in (409, 501)}
router = APIRouter(tags=["weights"])
admin = APIRouter(tags=["weights"])  # needs the token


@router.get("/v1/weights/version", response_model=P.WeightsVersion, responses={503: {"model": P.ErrorResponse}})
async def weights_version(farm=Depends(ingress)):
    """The version the replicas serve, each replica's own, and the replicas that did not answer (dead or
    restarting); 503 only when no replica answers."""
    return await farm.replicas.served(farm.settings.replicas)


SAFETENSORS_BODY = {  # the route streams the body itself: the schema says what it reads
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": "One safetensors file, or several back to back (buckets of whole tensors).",
                }
            }
        },
    }
}


@admin.post("/v1/weights", response_model=P.WeightsPushResponse, responses=PUSH_ERRORS, openapi_extra=SAFETENSORS_BODY)
async def push_weights(
    request: Request,
    version: int = Query(..., ge=1, le=P.INT64_MAX, description="The new version; higher than the served one."),
    policy: P.InFlightPolicy = Query(
        "finish", description="In-flight samples: finish on the old weights, abort and rerun, or go on (partial)."
    ),
    force: bool = Query(
        False,
        description="Push even though LoRA adapters made on the served base are resident: they are retired first "
        "(without it, such a push is a 409 naming them).",
    ),
    x_content_sha256: str | None = Header(
        None, pattern="^[0-9A-Fa-f]{64}$", description="Hex SHA-256 of the body; a mismatch is refused."
    ),
    farm=Depends(ingress),
):
    """Upload a safetensors state dict (raw body, streamed) as `version`: one safetensors file, or several back to
    back (buckets of whole tensors). The first may carry a manifest in its `__metadata__` ("farm": per tensor a
    checksum and full/same/xor, and a `base` version) for a bucketed push of only the changed tensors or a delta push
    (docs/api.md), and a probe under "probe" (token sequences and the logprobs the pusher computed for them:
    rollout_farm/services/weights/probe.py). Two phases: every replica stages it (and scores the probe on the staged
    weights), then all commit; if any replica refuses, none changes. Returns once all serve it. 409 with field `base`:
    the push does not apply to the served weights; send a full push. 422 with field `probe`: a replica's staged
    weights do not compute the probe's logprobs (the replica, sequence and token named). 501: the engine cannot score
    a probe."""
    declared = int(request.headers.get("content-length") or 0)
    with refusal_logged("upload", version):
        return await farm.weights.upload(request.stream(), declared, version, policy, x_content_sha256, force)


@admin.post("/v1/weights/path", response_model=P.WeightsPushResponse, responses=PUSH_ERRORS)
async def push_weights_path(body: P.WeightsFromPath, farm=Depends(ingress)):
    """Load a folder of safetensors files from storage every replica can read (no upload), in the same two phases;
    the body's `probe` (or a `probe.json` in the folder) is scored as an upload's. Keep the folder until a newer version
    is committed: replicas that start later load it from there."""
    with refusal_logged("path", body.version):
        return await farm.weights.from_path(body)


@admin.post("/v1/weights/distributed/init", responses=NCCL_ERRORS)
async def init_distributed(body: P.DistributedGroup, farm=Depends(ingress)):
    """Join every replica to the trainer's NCCL group (SGLang's init_weights_update_group); replica i takes rank
    rank_offset + i."""
    return await farm.weights.init_distributed(body)


@admin.post("/v1/weights/distributed", responses=NCCL_ERRORS)
async def push_distributed(body: P.DistributedUpdate, farm=Depends(ingress)):
    """Receive tensors the trainer broadcasts over NCCL (SGLang's update_weights_from_distributed) as `version`."""
    return await farm.weights.distributed(body)
