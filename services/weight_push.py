"""Weight pushes at the ingress: checked before any replica sees them, then two phases over every replica.

  stage   every replica checks the tensors and holds them next to the served ones; any refusal: all discard
  record  the WeightStore keeps the version and its source, so a replica that starts from now on loads it
  commit  every replica serves the new version (its in-flight samples follow the push's policy)

A push runs to its end even if its caller goes away: a push cut between its phases would not be atomic.
The NCCL transport (SGLang) has no staging phase: the tensors go straight into the engines.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import time
from collections.abc import Awaitable, Callable

import ray

from services import metrics
from services import protocol as P
from services.errors import Conflict, Invalid, ReplicasFailed
from services.replicas import Replicas
from services.settings import ServiceSettings
from services.weight_checks import WeightsError, check_state_dict, check_upload, read_header_file

log = logging.getLogger("farm.service")
SYNC_TIMEOUT = "FARM_WEIGHT_SYNC_TIMEOUT_S"


def run_to_end(coro: Awaitable):
    """Await `coro`; if our caller is cancelled, it still finishes."""
    return asyncio.shield(asyncio.ensure_future(coro))


def newer_than_served(version: int, served: dict[str, int], verb: str) -> int:
    """The newest version any replica serves; 409 unless `version` is above it."""
    current = max(served.values())
    if version <= current:
        raise Conflict(
            f"version {version} is not newer than the served version {current}: {verb} version {current + 1} or higher"
        )
    return current


class WeightPush:
    def __init__(self, replicas: Replicas, settings: ServiceSettings):
        self.replicas, self.settings = replicas, settings
        self.lock = asyncio.Lock()
        self.committed = 0  # the newest version committed through this ingress: no rollout runs on older weights
        self.spec: dict | None = None  # the model's tensors (name -> shape, dtype), asked once

    async def sync_committed(self) -> None:
        """At start-up: the version the replicas already serve (this ingress may be a restarted one); retried
        until the replicas answer."""
        while True:
            try:
                self.committed = max([self.committed, *(await self.replicas.versions()).values()])
                return
            except Exception as e:
                log.warning("replica_versions_unknown", extra={"error": repr(e)})
                await asyncio.sleep(2)

    async def served(self) -> P.WeightsVersion:
        """The version every replica serves, and each replica's own."""
        replicas = await self.replicas.versions()
        return P.WeightsVersion(version=min(replicas.values()), replicas=replicas)

    def upload(self, data: bytes, version: int, policy: P.InFlightPolicy) -> Awaitable[P.WeightsPushResponse]:
        """A safetensors blob, header-checked against the model, as `version`."""

        async def check(spec):
            return check_upload(data, spec)

        return run_to_end(self._push(version, policy, check, lambda: ("bytes", [ray.put(data)]), len(data)))

    def from_path(self, body: P.WeightsFromPath) -> Awaitable[P.WeightsPushResponse]:
        """A folder of safetensors files every replica can read (inside FARM_WEIGHTS_DIR when that is set)."""
        folder = pathlib.Path(body.path).resolve()
        root = self.settings.weights_dir
        if root and not folder.is_relative_to(pathlib.Path(root).resolve()):
            raise Invalid([{"field": "path", "message": f"{body.path} is outside FARM_WEIGHTS_DIR={root}"}])
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if not files:
            raise Invalid(
                [
                    {
                        "field": "path",
                        "message": f"no *.safetensors files in {body.path}: give a folder the service can read",
                    }
                ]
            )

        async def check(spec):
            got = {}
            for f in files:
                got.update(await asyncio.to_thread(read_header_file, f))
            if problems := check_state_dict(spec, got):
                raise WeightsError(problems)
            return len(got)

        size = sum(f.stat().st_size for f in files)
        return run_to_end(self._push(body.version, body.policy, check, lambda: ("path", str(folder)), size))

    async def _push(
        self, version: int, policy: str, check: Callable, source: Callable[[], tuple], size: int
    ) -> P.WeightsPushResponse:
        async with self.lock:
            start = time.perf_counter()
            current = newer_than_served(version, await self.replicas.versions(), "push")
            if self.spec is None:
                self.spec = await self.replicas.call("weight_spec")
            try:
                tensors = await check(self.spec)
            except WeightsError as e:
                raise Invalid(
                    [{"field": "body", "message": m} for m in e.problems],
                    "weights refused; the old version keeps serving",
                ) from None
            source, timeout = source(), self.settings.weight_sync_timeout_s
            if errors := await self.replicas.errors("stage", source, version, timeout_s=timeout, setting=SYNC_TIMEOUT):
                await self.replicas.each("discard", version)
                if all(isinstance(e, Invalid) for e in errors):  # every failing replica refused the content: 422
                    raise Invalid(list({str(d): d for e in errors for d in e.detail}.values()), errors[0].message)
                failed = [str(e).strip().splitlines()[-1] for e in errors]
                log.error("weight_stage_failed", extra={"version": version, "errors": failed})
                raise ReplicasFailed(
                    f"{len(failed)} replicas failed to stage version {version}; every replica stays "
                    f"on version {current}",
                    [{"field": "replica", "message": f} for f in failed],
                )
            await self.replicas.call("record", version, source)  # first: a replica starting from now on loads this
            if failed := await self.replicas.failures(
                "commit", version, policy, source, timeout_s=timeout, setting=SYNC_TIMEOUT
            ):
                log.error("weight_commit_failed", extra={"version": version, "errors": failed})
                raise ReplicasFailed(
                    f"{len(failed)} replicas failed to commit version {version}",
                    [{"field": "replica", "message": f} for f in failed],
                )
            self.committed = version
            seconds = time.perf_counter() - start
        metrics.VERSION.set(version)
        metrics.SYNC_SECONDS.observe(seconds)
        metrics.SYNC_BYTES.inc(size)
        log.info(
            "weights_pushed", extra={"version": version, "bytes": size, "policy": policy, "seconds": round(seconds, 3)}
        )
        return P.WeightsPushResponse(version=version, tensors=tensors, bytes=size, seconds=seconds)

    def init_distributed(self, group: P.DistributedGroup) -> Awaitable[dict]:
        """Every replica joins the trainer's NCCL group (SGLang's init_weights_update_group)."""
        return run_to_end(self._distributed("init_weights_update_group", group))

    def distributed(self, update: P.DistributedUpdate) -> Awaitable[dict]:
        """Every replica receives the tensors the trainer broadcasts (SGLang's update_weights_from_distributed)."""
        return run_to_end(self._distributed("update_weights_from_distributed", update))

    async def _distributed(self, method: str, body: P.DistributedGroup | P.DistributedUpdate) -> dict:
        async with self.lock:
            served = await self.replicas.versions()
            if isinstance(body, P.DistributedUpdate):
                newer_than_served(body.version, served, "send")
            # every replica gets the sorted replica ids, so each knows its own rank
            results = await self.replicas.all(
                method, body, sorted(served), timeout_s=self.settings.weight_sync_timeout_s
            )
            if isinstance(body, P.DistributedUpdate):
                self.committed = max(self.committed, body.version)
                metrics.VERSION.set(body.version)
        return {"replicas": len(results), "results": results}
