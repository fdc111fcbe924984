"""The rollout surface the routes call: check a request, start (or replay) its job, answer it whole or streamed,
cancel it. The work itself is in jobs.py (the request_id table), fanout.py and group_filter.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

from rollout_farm.services import protocol as P
from rollout_farm.services.rollout.fanout import Fanout
from rollout_farm.services.rollout.jobs import Job, RemoteJob, RolloutJobs, RunAgain
from rollout_farm.services.rollout.request_checks import RequestChecks


class Rollouts:
    def __init__(self, fanout: Fanout, checks: RequestChecks, jobs: RolloutJobs):
        self.fanout, self.checks, self.jobs = fanout, checks, jobs

    async def start(self, req: P.RolloutRequest) -> Job | RemoteJob:
        await self.checks.rollout(req)
        await self.fanout.resolve(req)  # an unknown adapter or version is a 4xx before any work starts
        return await self.jobs.start(req, lambda job: self.fanout.produce(job, req))

    async def answer(self, req: P.RolloutRequest) -> P.RolloutResponse:
        while True:
            try:
                return await self.jobs.result(await self.start(req), req.request_id)
            except RunAgain:  # the record's run failed or its replica died while this replay waited: run it here
                continue

    async def stream(self, req: P.RolloutRequest) -> AsyncIterator[str]:
        """NDJSON lines; the checks run before the first line, so a bad request is still a plain 422."""
        return self.jobs.lines(await self.start(req), req.request_id)

    async def cancel(self, request_id: str) -> P.CancelResponse:
        return P.CancelResponse(request_id=request_id, cancelled=await self.jobs.cancel(request_id))
