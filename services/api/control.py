"""Control of every replica (pause, resume, abort: token), health, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from services import metrics
from services import protocol as P
from services.api.deps import ingress
from services.state import STATE_ERRORS

SCRAPE_TIMEOUT_S = 10  # within Prometheus' default scrape timeout
router = APIRouter(tags=["control"])
admin = APIRouter(tags=["control"])  # needs the token


@admin.post("/v1/pause", response_model=P.ControlResponse)
async def pause(farm=Depends(ingress)):
    """Stop admitting generation on every replica; calls already running finish (or see /v1/abort)."""
    return await farm.replicas.control("pause")


@admin.post("/v1/resume", response_model=P.ControlResponse)
async def resume(farm=Depends(ingress)):
    """Admit generation again on every replica."""
    return await farm.replicas.control("resume")


@admin.post("/v1/abort", response_model=P.ControlResponse)
async def abort(farm=Depends(ingress)):
    """End the generation each replica is running at its next token; its samples finish with 'abort'."""
    return await farm.replicas.control("abort")


@router.get("/healthz", response_model=P.Health)
async def healthz(farm=Depends(ingress)):
    """Alive: an engine replica generates a token (or reports that sampling is paused)."""
    return await farm.replicas.call("health")


@router.get("/readyz", response_model=P.Readiness, responses={503: {"model": P.ErrorResponse}})
async def readyz(farm=Depends(ingress)):
    """Ready for rollouts: no replica is paused and every replica serves the same weight version."""
    return await farm.replicas.readiness()


@router.get("/metrics")
async def prometheus(farm=Depends(ingress)):
    """Prometheus metrics: the ingress's own, the queue's, and each replica's version and tokens."""
    states = await farm.replicas.states(timeout_s=SCRAPE_TIMEOUT_S)
    try:
        await farm.queue.states()  # the queue gauges, as of now
    except STATE_ERRORS:  # Redis away: the last ones, and the rest of the scrape
        pass
    me, texts = await farm.ingress_metrics()
    return Response(metrics.exposition(states, texts, me), media_type=CONTENT_TYPE_LATEST)
