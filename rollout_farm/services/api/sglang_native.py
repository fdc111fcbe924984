"""SGLang's native HTTP surface (sglang 0.5.14): /generate, the model and server reads, health, and the weight and
generation control routes (token), translated onto the farm's domain objects by
rollout_farm/services/compat/sglang_native.py."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import StreamingResponse

from rollout_farm.services.api.deps import caller, ingress
from rollout_farm.services.api.errors import refusal_logged
from rollout_farm.services.compat.sglang_shapes import sse
from rollout_farm.services.protocol import ErrorResponse
from rollout_farm.services.protocol import sglang_native as S
from rollout_farm.services.tenants.registry import Principal

ERRORS = {code: {"model": ErrorResponse} for code in (404, 409, 422, 429)}
WEIGHT_ERRORS = {code: {"model": ErrorResponse} for code in (409, 422, 501)}
router = APIRouter(tags=["sglang"])
generation = APIRouter(tags=["sglang"])  # needs the token where FARM_REQUIRE_TOKEN_FOR_GENERATION is on
admin = APIRouter(tags=["sglang"])  # needs the token


@generation.api_route("/generate", methods=["POST", "PUT"], responses=ERRORS)
async def generate(req: S.GenerateRequest, who: Principal = Depends(caller), farm=Depends(ingress)):
    """SGLang's /generate: text or input_ids, single or batch; `stream` answers SGLang's SSE (whole-answer chunks).
    `lora_path` names a LoRA adapter ("name@vN" or "name"), one or one per prompt."""
    async with farm.tenants.admitted(who, farm.sglang_native.samples(req)) as took:
        out = await farm.sglang_native.generate(req, who)
        took(sum(a["meta_info"]["completion_tokens"] for a in (out if isinstance(out, list) else [out])))
    if not req.stream:
        return out
    return StreamingResponse(iter(sse(out)), media_type="text/event-stream")


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(farm=Depends(ingress)):
    """The model, and the committed weight version as `weight_version`."""
    return await farm.sglang_native.model_info()


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(farm=Depends(ingress)):
    """The server args SGLang clients read, and each replica's state as internal_states."""
    return await farm.sglang_native.server_info()


@router.get("/health")
@router.get("/health_generate")
async def health(farm=Depends(ingress)):
    """200 once the replicas that answer sample a token (as /healthz); 503 while generation is paused, or when a
    replica cannot sample."""
    state = await farm.replicas.health(farm.settings.replicas)
    return Response(status_code=200 if state.status == "ok" else 503)


@admin.post("/update_weights_from_disk", responses=WEIGHT_ERRORS)
async def update_weights_from_disk(req: S.UpdateWeightsFromDiskRequest, farm=Depends(ingress)):
    """A folder of safetensors files as the next weight version (the farm's path push, two phases)."""
    with refusal_logged("path", req.weight_version):
        return await farm.sglang_native.update_from_disk(req)


@admin.post("/init_weights_update_group", responses=WEIGHT_ERRORS)
async def init_weights_update_group(req: S.InitWeightsUpdateGroupRequest, farm=Depends(ingress)):
    """Every replica joins the trainer's NCCL group (501 on an engine without the NCCL transport)."""
    return await farm.sglang_native.init_group(req)


@admin.post("/update_weights_from_distributed", responses=WEIGHT_ERRORS)
async def update_weights_from_distributed(req: S.UpdateWeightsFromDistributedRequest, farm=Depends(ingress)):
    """Receive the tensors the trainer broadcasts as the next weight version."""
    return await farm.sglang_native.update_distributed(req)


@admin.post("/pause_generation", responses=WEIGHT_ERRORS)
async def pause_generation(req: S.PauseGenerationRequest | None = None, farm=Depends(ingress)):
    """Admit nothing new until /continue_generation; what runs ends at its next token ('abort', the default) or is
    held ('in_place': at a step boundary with its KV cache; 'retract': back to the waiting queue)."""
    return await farm.sglang_native.pause(req or S.PauseGenerationRequest())


@admin.post("/continue_generation")
async def continue_generation(req: S.ContinueGenerationRequest | None = None, farm=Depends(ingress)):
    return await farm.sglang_native.resume()


@admin.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache():
    """The farm's engines keep no prefix cache across requests: nothing to flush."""
    return Response(
        "Cache flushed.\nThe farm's engines keep no prefix cache across requests.\n", media_type="text/plain"
    )


@admin.post("/abort_request")
async def abort_request(req: S.AbortRequest, farm=Depends(ingress)):
    """End the /generate sent with this string rid at its next token: it answers with its tokens so far, finished
    'abort'. abort_all: every running generation."""
    await farm.sglang_native.abort(req)
    return Response(status_code=200)
