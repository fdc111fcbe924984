"""Weight pushes at the ingress: checked before any replica sees them, then two phases over every replica.

  stage   every replica checks the tensors and holds them next to the served ones; any refusal: all discard
  record  the WeightStore keeps the version and its source, so a replica that starts from now on loads it
  commit  every replica serves the new version (its in-flight samples follow the push's policy)

A push runs to its end even if its caller goes away: a push cut between its phases would not be atomic.
One push at a time across every ingress replica (a lock in Redis). The committed version is read from Redis
(services/weight_store.py writes it), so every ingress replica floors rollouts at the same version.
The NCCL transport (SGLang) has no staging phase: the tensors go straight into the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import time
from collections.abc import Awaitable, Callable

import ray
from redis.asyncio import Redis
from redis.exceptions import LockError

from services import metrics
from services import protocol as P
from services.errors import Conflict, Invalid, ReplicasFailed
from services.replicas import Replicas, lost
from services.settings import ServiceSettings
from services.weight_checks import WeightsError, check_state_dict, check_upload, read_header_file
from services.weight_store import weights_key

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
    def __init__(self, replicas: Replicas, settings: ServiceSettings, r: Redis, prefix: str):
        self.replicas, self.settings, self.r = replicas, settings, r
        self.key = weights_key(prefix)
        self.lock = r.lock(f"{prefix}:push-lock", timeout=settings.weight_sync_timeout_s * 2 + 60, sleep=0.05)
        self.committed = 0  # the committed version, as last read from Redis: no rollout runs on older weights
        self.spec: dict | None = None  # the model's tensors (name -> shape, dtype), asked once

    async def refresh(self) -> int:
        self.committed = int(await self.r.hget(self.key, "version") or 0)
        return self.committed

    @contextlib.asynccontextmanager
    async def _locked(self):
        """The push lock, or 409 when another push holds it past FARM_WEIGHT_SYNC_TIMEOUT_S."""
        if not await self.lock.acquire(blocking_timeout=self.settings.weight_sync_timeout_s):
            raise Conflict(f"another weight push is running for longer than {SYNC_TIMEOUT}: retry later")
        try:
            yield
        finally:
            try:
                await self.lock.release()
            except LockError:  # it expired: nothing to release
                pass

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
        async with self._locked():
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
            errors = await self.replicas.errors("stage", source, version, timeout_s=timeout, setting=SYNC_TIMEOUT)
            if errors := self._without_lost(errors, "stage", version):
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
            errors = await self.replicas.errors(
                "commit", version, policy, source, timeout_s=timeout, setting=SYNC_TIMEOUT
            )
            if failed := [str(e).strip().splitlines()[-1] for e in self._without_lost(errors, "commit", version)]:
                log.error("weight_commit_failed", extra={"version": version, "errors": failed})
                raise ReplicasFailed(
                    f"{len(failed)} replicas failed to commit version {version}",
                    [{"field": "replica", "message": f} for f in failed],
                )
            self.committed = version  # the store wrote it to Redis, for the other ingress replicas
            seconds = time.perf_counter() - start
        metrics.VERSION.set(version)
        metrics.SYNC_SECONDS.observe(seconds)
        metrics.SYNC_BYTES.inc(size)
        log.info(
            "weights_pushed", extra={"version": version, "bytes": size, "policy": policy, "seconds": round(seconds, 3)}
        )
        return P.WeightsPushResponse(version=version, tensors=tensors, bytes=size, seconds=seconds)

    @staticmethod
    def _without_lost(errors: list[Exception], phase: str, version: int) -> list[Exception]:
        """The failures that refuse the push: a replica that died is no refusal (Serve replaces it, and the new one
        loads the recorded version before it serves)."""
        gone = [e for e in errors if lost(e)]
        if gone:
            log.warning("weight_push_replica_lost", extra={"phase": phase, "version": version, "replicas": len(gone)})
        return [e for e in errors if not lost(e)]

    def init_distributed(self, group: P.DistributedGroup) -> Awaitable[dict]:
        """Every replica joins the trainer's NCCL group (SGLang's init_weights_update_group)."""
        return run_to_end(self._distributed("init_weights_update_group", group))

    def distributed(self, update: P.DistributedUpdate) -> Awaitable[dict]:
        """Every replica receives the tensors the trainer broadcasts (SGLang's update_weights_from_distributed)."""
        return run_to_end(self._distributed("update_weights_from_distributed", update))

    async def _distributed(self, method: str, body: P.DistributedGroup | P.DistributedUpdate) -> dict:
        async with self._locked():
            served = await self.replicas.versions()
            if isinstance(body, P.DistributedUpdate):
                newer_than_served(body.version, served, "send")
            # every replica gets the sorted replica ids, so each knows its own rank
            results = await self.replicas.all(
                method, body, sorted(served), timeout_s=self.settings.weight_sync_timeout_s
            )
            if isinstance(body, P.DistributedUpdate):  # no copy to load from: a restarted replica serves the base
                await self.r.hset(self.key, mapping={"version": body.version, "kind": "nccl", "path": ""})
                self.committed = max(self.committed, body.version)
                metrics.VERSION.set(body.version)
        return {"replicas": len(results), "results": results}
