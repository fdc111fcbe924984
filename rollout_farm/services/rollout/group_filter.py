"""dynamic_group_filter's scheduler (DAPO's dynamic sampling) at the ingress: engine calls of prompts_per_call
prompts, at most replicas x FARM_ENGINE_MAX_ONGOING_REQUESTS at once, until target_groups informative groups are
kept or max_groups were started; then the calls still running are cancelled (their engine work stops at the next
token). Zero-variance and surplus groups are dropped, and the FilterReport says what that cost."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from typing import Protocol

from rollout_farm.services import protocol as P
from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.errors import Overloaded
from rollout_farm.services.extensions.samplers import DynamicGroupFilter, make_sampler
from rollout_farm.services.observability import metrics
from rollout_farm.services.rollout.jobs import Job
from rollout_farm.services.rollout.policy_check import check_policy
from rollout_farm.services.rollout.policy_stats import PolicyStatsBoard

log = logging.getLogger("farm.service")
MAX_PUSHBACKS = 100  # calls sent back by full queues before the filter gives up waiting


class Chunks(Protocol):
    """What the filter uses of the Fanout (rollout_farm/services/rollout/fanout.py) that hands a request to it."""

    settings: ServiceSettings
    policy: PolicyStatsBoard

    def committed(self) -> int: ...
    def floor(self, req: P.RolloutRequest) -> int: ...
    def call(self, req, prompts, chunk, params, floor, meta, spec): ...
    def record(self, sampler: str, generated: list[P.Group], delivered: list[P.Group]) -> None: ...


async def produce(
    fanout: Chunks, job: Job, req: P.RolloutRequest, flt: DynamicGroupFilter, delivered: bool
) -> P.RolloutResponse:
    p, settings = flt.params, fanout.settings
    inner = make_sampler(p.inner, settings.plugins)
    params, meta = await fanout.policy.plan(p.inner.name, inner, req.sampling_params, fanout.committed())
    meta = {**meta, "filter": req.sampler.name}
    target, cap = p.target_groups or len(req.prompts), min(p.max_groups or len(req.prompts), len(req.prompts))
    todo = deque(
        (j, list(range(a, min(a + p.prompts_per_call, cap)))) for j, a in enumerate(range(0, cap, p.prompts_per_call))
    )
    window = max(1, settings.replicas * settings.engine_max_ongoing_requests)  # shrinks when Serve pushes back
    floor = fanout.floor(req)
    running: dict[asyncio.Future, tuple[int, list[int], object]] = {}  # -> (chunk index, prompt indices, Serve call)
    finished: list[tuple[str, P.Group]] = []  # (outcome, group) in finishing order
    kept = pushbacks = 0

    async def wait(call):
        return await call

    try:
        while kept < target:
            while len(running) < window and todo:
                j, chunk = todo.popleft()
                call = fanout.call(req, chunk, j, params, floor, meta, p.inner)
                running[asyncio.ensure_future(wait(call))] = (j, chunk, call)
            if not running:
                break
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                j, chunk, _ = running.pop(fut)
                if isinstance(fut.exception(), Overloaded) and pushbacks < MAX_PUSHBACKS:
                    pushbacks += 1  # queues full: again once a call finishes
                    todo.appendleft((j, chunk))
                    window = max(1, len(running))
                    if not running:
                        await asyncio.sleep(0.1)
                    continue
                for i, group in zip(chunk, check_policy(fut.result(), req._resolved_adapter)):
                    group.prompt_index = i
                    outcome = "zero_variance" if flt.zero_variance(group) else "kept" if kept < target else "surplus"
                    finished.append((outcome, group))
                    if outcome == "kept":
                        kept += 1
                        job.add(i, group)
    finally:
        cancelled = sum(len(chunk) for _, chunk, _ in running.values())
        for fut, (_, _, call) in running.items():  # the surplus: its engine work stops at the next token
            call.cancel()
            fut.cancel()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" noise
    job.report = report = filter_report(target, finished, cancelled)
    groups = [job.groups[i] for i in sorted(job.groups)]
    fanout.record(req.sampler.name, [g for _, g in finished], groups if delivered else [])  # the zero-variance fraction
    log.info("group_filter", extra=report.model_dump())
    return P.RolloutResponse(groups=groups, filter=report)


def filter_report(target: int, finished: list[tuple[str, P.Group]], cancelled: int) -> P.FilterReport:
    """What the filter generated and kept; also counted in farm_filter_groups_total and
    farm_filter_wasted_tokens_total."""
    count = Counter(outcome for outcome, _ in finished)
    generated = sum(g.generated_tokens or 0 for _, g in finished)  # every candidate of every finished group
    kept_tokens = sum(len(s.token_ids) for o, g in finished if o == "kept" for s in g.samples)
    for outcome in ("kept", "zero_variance", "surplus"):
        metrics.FILTER_GROUPS.labels(outcome).inc(count[outcome])
    metrics.FILTER_GROUPS.labels("cancelled").inc(cancelled)
    metrics.FILTER_WASTED_TOKENS.inc(generated - kept_tokens)
    return P.FilterReport(
        target_groups=target,
        target_reached=count["kept"] >= target,
        generated_groups=len(finished),
        kept_groups=count["kept"],
        zero_variance_groups=count["zero_variance"],
        zero_variance_fraction=count["zero_variance"] / max(1, len(finished)),
        surplus_groups=count["surplus"],
        cancelled_groups=cancelled,
        generated_tokens=generated,
        kept_tokens=kept_tokens,
        waste_fraction=1 - kept_tokens / generated if generated else 0.0,
    )
