"""POST /v1/episodes (JSON or NDJSON stream): groups of multi-turn episodes, each driven by an environment plug-in;
GET /v1/environments lists them. The work is rollout_farm/services/episodes/episodes.py."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from rollout_farm.services import protocol as P
from rollout_farm.services.api.adapters import may_sample
from rollout_farm.services.api.deps import admitted_stream, caller, episode_line_tokens, ingress
from rollout_farm.services.episodes.environments import ENVIRONMENTS
from rollout_farm.services.protocol import episodes as E
from rollout_farm.services.tenants.registry import Principal

ERRORS = {code: {"model": P.ErrorResponse} for code in (404, 409, 422, 429)}
router = APIRouter(tags=["episodes"])


@router.post("/v1/episodes", response_model=E.EpisodeResponse, responses=ERRORS)
async def episodes(req: E.EpisodeRequest, who: Principal = Depends(caller), farm=Depends(ingress)):
    """n episodes per prompt, run concurrently; one group per prompt, in order. With `stream`, NDJSON: an
    EpisodeGroup line per group as it finishes, then an EpisodeStreamEnd line. With `adapter`, every turn samples
    from that LoRA adapter (one the caller may use). The episodes' sessions are the caller's tenant's: another
    tenant's token gets a 404 on them. The sampled tokens count against the tenant's tokens_per_s."""
    await may_sample(farm, req.adapter, who)
    samples = len(req.prompts) * req.n  # episodes in flight, against the caller's tenant quota and fair share
    if req.stream:
        lines = await admitted_stream(farm, who, samples, lambda: farm.episodes.stream(req, who), episode_line_tokens)
        return StreamingResponse(lines, media_type="application/x-ndjson")
    async with farm.tenants.admitted(who, samples) as took:
        out = await farm.episodes.run(req, who)
        took(sampled(out))
    return out


def sampled(out: E.EpisodeResponse) -> int:
    """The tokens the episodes sampled: those with a weight version."""
    segments = (seg for g in out.groups for e in g.episodes for seg in e.segments)
    return sum(v >= 0 for seg in segments for v in seg.token_versions)


@router.get("/v1/environments", response_model=E.EnvironmentList)
async def environments():
    """Registered environments: what each is, and its params' JSON Schema."""
    kinds = {n: ENVIRONMENTS.get(n) for n in ENVIRONMENTS.names()}
    return E.EnvironmentList(
        environments={n: (k.__doc__ or "").strip() for n, k in kinds.items()},
        params={n: k.Params.model_json_schema() for n, k in kinds.items()},
    )
