"""Control of every replica (pause, resume, abort: token), health, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from rollout_farm.services import protocol as P
from rollout_farm.services.api.deps import ingress
from rollout_farm.services.errors import STATE_ERRORS
from rollout_farm.services.observability import metrics

SCRAPE_TIMEOUT_S = 10  # within Prometheus' default scrape timeout
router = APIRouter(tags=["control"])
admin = APIRouter(tags=["control"])  # needs the token


@admin.post("/v1/pause", response_model=P.ControlResponse)
async def pause(farm=Depends(ingress)):
    """Stop admitting generation on every replica; calls already running finish (or see /v1/abort). A generating
    request (rollouts, OpenAI, /generate, session turns, episodes) that meets the pause waits for /v1/resume at most
    FARM_PAUSE_WAIT_S (default 30 s; 0: no bound), then answers 503 with Retry-After, its error naming the pause
    (since when, how long it waited): send it again after the resume (a request_id runs anew). The queue keeps its
    prompts and generates them after the resume."""
    return await farm.replicas.control("pause")


@admin.post("/v1/resume", response_model=P.ControlResponse)
async def resume(farm=Depends(ingress)):
    """Admit generation again on every replica."""
    return await farm.replicas.control("resume")


@admin.post("/v1/abort", response_model=P.ControlResponse)
async def abort(farm=Depends(ingress)):
    """End the generation each replica is running at its next token; its samples finish with 'abort'."""
    return await farm.replicas.control("abort")


@router.get("/healthz", response_model=P.Health, responses={503: {"model": P.ErrorResponse}})
async def healthz(farm=Depends(ingress)):
    """Alive: every engine replica that answers samples a token (or reports that sampling is paused). 503 naming
    the replica and its error when one cannot sample, or when none answers; replicas that are dead or restarting
    are listed under `unreachable` while another one is healthy."""
    return await farm.replicas.health(farm.settings.replicas)


@router.get("/readyz", response_model=P.Readiness, responses={503: {"model": P.ErrorResponse}})
async def readyz(farm=Depends(ingress)):
    """Ready for rollouts: every replica answers, none is paused, and all serve the same weight version; else 503
    naming the replicas that are missing, paused or behind."""
    return await farm.replicas.readiness(farm.settings.replicas)


@router.get("/metrics")
async def prometheus(farm=Depends(ingress)):
    """Prometheus metrics: the ingress's own, the queue's, and each answering replica's version and tokens."""
    states = await farm.replicas.states(timeout_s=SCRAPE_TIMEOUT_S)
    try:
        await farm.queue.states()  # the queue gauges, as of now
    except STATE_ERRORS:  # Redis away: the last ones, and the rest of the scrape
        pass
    me, texts = await farm.ingress_metrics()
    return Response(metrics.exposition(states.answers, texts, me), media_type=CONTENT_TYPE_LATEST)
