"""Weight pushes at the ingress: checked before any replica sees them, then two phases over every replica.

  stage   every replica checks the tensors and holds them next to the served ones; any refusal: all discard.
          An upload's buckets are staged as they arrive, while the next one streams
          (rollout_farm/services/weights/early.py); the stage phase then checks the whole push on every replica,
          and scores the push's probe, if any, on the staged weights (rollout_farm/services/weights/probe.py)
  record  the WeightStore keeps the version and its source, so a replica that starts from now on loads it
  commit  every replica serves the new version (its in-flight samples follow the push's policy)

A push runs to its end even if its caller goes away: a push cut between its phases would not be atomic; an upload
cut while it streams is discarded on every replica. One push at a time across every ingress replica (a lock in
Redis, held by an upload from its first byte, and renewed with each bucket). The committed version is read from Redis
(rollout_farm/services/weights/store.py writes it), so every ingress replica floors rollouts at the same version.
The NCCL transport (SGLang) has no staging phase: the tensors go straight into the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import pathlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import LockError

from rollout_farm.services import protocol as P
from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.errors import Conflict, Invalid, NotSupported, ReplicasFailed, TooLarge, replica_gone
from rollout_farm.services.observability import metrics
from rollout_farm.services.weights import probe as probes
from rollout_farm.services.weights.checks import DTYPE_BYTES, WeightsError, check_state_dict, read_header_file
from rollout_farm.services.weights.early import EarlyStage
from rollout_farm.services.weights.stage import FULL_PUSH
from rollout_farm.services.weights.store import weights_key
from rollout_farm.services.weights.stream import Body, check_sha256, receive

log = logging.getLogger("farm.service")
SYNC_TIMEOUT = "FARM_WEIGHT_SYNC_TIMEOUT_S"
REFUSED = "weights refused; the old version keeps serving"
HOLD_ABOVE = 16 << 20  # uploads larger than this are copied by the store while the replicas stage
CHAIN_MODELS, CHAIN_FLOOR = 2, 64 << 20  # the store keeps deltas up to twice the model's size, at least 64 MiB


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


def refusal(errors: list[Exception], version: int, current: int) -> Exception:
    """What a failed stage answers: 422 when every failing replica refused the content, 409 when one refused the
    base, 501 when an engine cannot score the push's probe, else 500 naming the replicas."""
    detail = list({str(d): d for e in errors for d in getattr(e, "detail", [])}.values())
    if unsupported := [e for e in errors if isinstance(e, NotSupported)]:
        return unsupported[0]
    if all(isinstance(e, Invalid) for e in errors):
        return Invalid(detail, errors[0].message)
    if all(isinstance(e, (Invalid, Conflict)) for e in errors):
        return Conflict(next(e for e in errors if isinstance(e, Conflict)).message, detail)
    failed = [str(e).strip().splitlines()[-1] for e in errors]
    log.error("weight_stage_failed", extra={"version": version, "errors": failed})
    return ReplicasFailed(
        f"{len(failed)} replicas failed to stage version {version}; every replica stays on version {current}",
        [{"field": "replica", "message": f} for f in failed],
    )


class WeightPush:
    def __init__(self, replicas, settings: ServiceSettings, r: Redis, prefix: str):
        """`replicas` is the ingress's handle on the engine replicas (rollout_farm.services.replica.handle.Replicas). It
        is given, not imported: the replicas import this package to stage weights, and packages import one way only."""
        self.replicas, self.settings, self.r = replicas, settings, r
        self.key = weights_key(prefix)
        self.lock = r.lock(f"{prefix}:push-lock", timeout=settings.weight_sync_timeout_s * 2 + 60, sleep=0.05)
        self.committed = 0  # the committed version, as last read from Redis: no rollout runs on older weights
        self.spec: dict | None = None  # the model's tensors (name -> shape, dtype), asked once
        # set by the ingress (rollout_farm/services/adapters/push.py): refuses a base push while adapters made on the
        # served base are resident, or with force retires them first
        self.base_guard: Callable[[bool], Awaitable[None]] | None = None

    async def _guard(self, force: bool) -> None:
        if self.base_guard is not None:
            await self.base_guard(force)

    async def refresh(self) -> int:
        self.committed = int(await self.r.hget(self.key, "version") or 0)
        return self.committed

    @contextlib.asynccontextmanager
    async def _locked(self):
        """The push lock, or 409 when another push holds it past FARM_WEIGHT_SYNC_TIMEOUT_S."""
        await self._acquire()
        try:
            yield
        finally:
            await self._release()

    async def _acquire(self) -> None:
        if not await self.lock.acquire(blocking_timeout=self.settings.weight_sync_timeout_s):
            raise Conflict(f"another weight push is running for longer than {SYNC_TIMEOUT}: retry later")

    async def _release(self) -> None:
        try:
            await self.lock.release()
        except LockError:  # it expired: nothing to release
            pass

    async def _renew(self) -> None:
        """The lock's full time again (an upload renews it with each bucket); 409 if it expired meanwhile."""
        try:
            await self.lock.reacquire()
        except LockError:
            raise Conflict(
                f"the upload streamed for longer than the push lock lasts (twice {SYNC_TIMEOUT}, plus a minute) "
                "without a bucket: send it faster, or in smaller buckets"
            ) from None

    async def upload(
        self,
        chunks: AsyncIterator[bytes],
        declared: int,
        version: int,
        policy: P.InFlightPolicy,
        sha256: str | None,
        force: bool = False,
    ) -> P.WeightsPushResponse:
        """A streamed upload (one or more safetensors buckets, rollout_farm/services/weights/buckets.py), checked bucket
        by bucket against the model as it arrives, put in the object store once and staged on every replica while the
        next bucket streams, as `version`. The push lock is held from the start: the replicas stage one push at a
        time."""
        limit = self.settings.max_weights_bytes
        too_large = TooLarge(
            f"upload larger than FARM_MAX_WEIGHTS_BYTES={limit}: raise it, or push a folder by path "
            "(POST /v1/weights/path)"
        )
        if declared > limit:
            raise too_large
        await self._guard(force)
        if self.spec is None:
            self.spec = await self.replicas.call("weight_spec")
        await self._acquire()
        early = None
        try:
            served = await self.replicas.versions()
            current = newer_than_served(version, served, "push")
            early = self._early(version, current, declared)

            async def on_manifest(manifest):  # a push with a base that cannot apply: 409 before its tensors stream in
                if manifest is not None and manifest.base is not None:
                    await self._check_base(manifest.base, served, declared)

            async def on_bucket(*bucket):
                await self._renew()
                await early.bucket(*bucket)

            body = Body(chunks, limit, too_large, hashed=bool(sha256))
            try:
                got = await receive(body, self.spec, on_manifest, on_bucket)
            except WeightsError as e:
                raise Invalid([{"field": "body", "message": m} for m in e.problems], REFUSED) from None
            start = time.perf_counter()
            if sha256:
                check_sha256(sha256, got.sha256)
            if got.manifest is not None and got.manifest.base is not None and got.bytes > declared:  # chunked
                await self._check_base(got.manifest.base, served, got.bytes)
            await early.settle()
            await self._renew()
        except BaseException:  # refused, cut, or the caller gone: every replica drops what it staged
            await run_to_end(self._abandon(early))
            raise
        base = got.manifest.base if got.manifest else None
        if base is None:
            source = ("bytes", got.refs)
        else:
            source = ("delta", {"base": base, "refs": got.refs, "bytes": got.bytes})
        push = self._phases(
            version, policy, source, got.bytes, current, len(self.spec), start, base, len(got.names), early, got.probe
        )
        return await run_to_end(self._unlocking(push, early))

    def _early(self, version: int, current: int, declared: int) -> EarlyStage:
        """The upload's buckets to every replica as they arrive; a replica's refusal refuses the push."""

        def refuse(errors: list[Exception]) -> Exception | None:
            errors = self._without_lost(errors, "stage", version)
            return refusal(errors, version, current) if errors else None

        timeout = self.settings.weight_sync_timeout_s
        return EarlyStage(self.replicas, version, timeout, SYNC_TIMEOUT, refuse, hold=declared > HOLD_ABOVE)

    async def _abandon(self, early: EarlyStage | None) -> None:
        try:
            if early is not None:
                await early.abandon()
        finally:
            await self._release()

    async def _unlocking(self, push: Awaitable, early: EarlyStage):
        try:
            return await push
        except BaseException:
            await early.held()  # the store's copy of a refused push: done before the next push starts
            raise
        finally:
            await self._release()

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
            await self._guard(body.force)
            nonlocal probe
            probe = probes.one_of(probes.parse(body.probe), await asyncio.to_thread(probes.in_folder, folder))
            got = {}
            for f in files:
                got.update(await asyncio.to_thread(read_header_file, f))
            if problems := check_state_dict(spec, got):
                raise WeightsError(problems)
            return len(got)

        probe = None
        size = sum(f.stat().st_size for f in files)
        push = self._push(body.version, body.policy, check, lambda: ("path", str(folder)), size, lambda: probe)
        return run_to_end(push)

    async def _push(self, version: int, policy: str, check: Callable, source: Callable, size: int, probe: Callable):
        """The two phases over every replica, under the push lock: admit, stage, record, commit (`source()` and
        `probe()` as `check` found them)."""
        async with self._locked():
            start = time.perf_counter()
            current, tensors = await self._admit(version, check)
            return await self._phases(version, policy, source(), size, current, tensors, start, probe=probe())

    async def _phases(
        self,
        version: int,
        policy: str,
        where: tuple,
        size: int,
        current: int,
        tensors: int,
        start: float,
        base: int | None = None,
        sent: int | None = None,
        early: EarlyStage | None = None,
        probe: probes.Probe | None = None,
    ) -> P.WeightsPushResponse:
        """stage, record, commit, the push lock held (`early`: an upload's buckets were staged as they came, and the
        stage phase checks the whole push; `probe`: every replica scores it on the staged weights)."""
        await self._stage(version, where, size, current, early, probe)
        await self._record(version, where, current)
        await self._commit(version, policy, where)
        self.committed = version  # the store wrote it to Redis, for the other ingress replicas
        seconds = time.perf_counter() - start
        metrics.VERSION.set(version)
        metrics.SYNC_SECONDS.observe(seconds)
        metrics.SYNC_BYTES.inc(size)
        log.info(
            "weights_pushed", extra={"version": version, "bytes": size, "policy": policy, "seconds": round(seconds, 3)}
        )
        return P.WeightsPushResponse(
            version=version, tensors=tensors, bytes=size, seconds=seconds, base=base, sent_tensors=sent
        )

    async def _admit(self, version: int, check: Callable) -> tuple[int, int]:
        """(the newest served version, the number of tensors): 409 unless `version` is newer, 422 unless the weights
        fit the model."""
        current = newer_than_served(version, await self.replicas.versions(), "push")
        if self.spec is None:
            self.spec = await self.replicas.call("weight_spec")
        try:
            return current, await check(self.spec)
        except WeightsError as e:
            raise Invalid([{"field": "body", "message": m} for m in e.problems], REFUSED) from None

    async def _stage(self, version: int, source: tuple, size: int, current: int, early: EarlyStage | None, probe=None):
        """Phase one: every replica stages, or (an upload's buckets staged as they came) checks the whole push, then
        scores the probe on what it staged; any refusal and every replica discards. A large upload is copied by the
        store meanwhile (rollout_farm/services/weights/store.py; the buckets it has not copied yet as they came), a
        small one at the commit."""
        big = source[0] != "path" and size > HOLD_ABOVE
        hold = None
        if big and early is not None:
            hold = early.hold_rest(source)
        elif big:
            hold = asyncio.ensure_future(self.replicas.call("record", version, source, True))
        probe_json = probe.model_dump_json() if probe is not None else None
        errors = await self.replicas.errors(
            "stage", source, version, probe_json, timeout_s=self.settings.weight_sync_timeout_s, setting=SYNC_TIMEOUT
        )
        with contextlib.suppress(Exception):  # a failed copy is taken again at the commit
            await hold if hold else None
        if errors := self._without_lost(errors, "stage", version):
            await self.replicas.each("discard", version)
            raise refusal(errors, version, current)

    async def _record(self, version: int, source: tuple, current: int) -> None:
        """Before the commit: a replica starting from now on loads this version."""
        try:
            await self.replicas.call("record", version, source)
        except Exception as e:
            await self.replicas.each("discard", version)
            detail = [{"field": "base", "message": str(e).strip().splitlines()[-1]}]
            message = f"the weight store cannot record version {version}; every replica stays on {current}"
            raise Conflict(message, detail) from None

    async def _commit(self, version: int, policy: str, source: tuple) -> None:
        """Phase two: every replica serves the version (a replica that missed phase one stages from `source`)."""
        errors = await self.replicas.errors(
            "commit", version, policy, source, timeout_s=self.settings.weight_sync_timeout_s, setting=SYNC_TIMEOUT
        )
        if failed := [str(e).strip().splitlines()[-1] for e in self._without_lost(errors, "commit", version)]:
            log.error("weight_commit_failed", extra={"version": version, "errors": failed})
            raise ReplicasFailed(
                f"{len(failed)} replicas failed to commit version {version}",
                [{"field": "replica", "message": f} for f in failed],
            )

    async def _check_base(self, base: int, served: dict[str, int], size: int) -> None:
        """409 (field base) unless every replica serves `base`, and the store's chain of deltas stays under the
        model's size with this one (else a replica starting later would replay too much)."""
        if set(served.values()) != {base}:
            raise Conflict(
                f"the push applies to base version {base}, but the replicas serve {sorted(set(served.values()))}: "
                f"{FULL_PUSH}",
                [{"field": "base", "message": f"send a full push; the replicas serve {max(served.values())}"}],
            )
        chain = int(await self.r.hget(self.key, "chain_bytes") or 0)
        model = sum(math.prod(shape) * DTYPE_BYTES.get(dtype, 4) for shape, dtype in self.spec.values())
        if chain + size > max(CHAIN_MODELS * model, CHAIN_FLOOR):
            raise Conflict(
                f"the deltas since the last full push ({chain} bytes, and {size} now) would pass {CHAIN_MODELS}x the "
                f"model's size ({model} bytes; at least {CHAIN_FLOOR}), which the store keeps for replicas that start "
                "later: "
                f"{FULL_PUSH}",
                [{"field": "base", "message": "send a full push"}],
            )

    @staticmethod
    def _without_lost(errors: list[Exception], phase: str, version: int) -> list[Exception]:
        """The failures that refuse the push: a replica that died is no refusal (Serve replaces it, and the new one
        loads the recorded version before it serves)."""
        gone = [e for e in errors if replica_gone(e)]
        if gone:
            log.warning("weight_push_replica_lost", extra={"phase": phase, "version": version, "replicas": len(gone)})
        return [e for e in errors if not replica_gone(e)]

    def init_distributed(self, group: P.DistributedGroup) -> Awaitable[dict]:
        """Every replica joins the trainer's NCCL group (SGLang's init_weights_update_group)."""
        return run_to_end(self._distributed("init_weights_update_group", group))

    def distributed(self, update: P.DistributedUpdate) -> Awaitable[dict]:
        """Every replica receives the tensors the trainer broadcasts (SGLang's update_weights_from_distributed)."""
        return run_to_end(self._distributed("update_weights_from_distributed", update))

    async def _distributed(self, method: str, body: P.DistributedGroup | P.DistributedUpdate) -> dict:
        if isinstance(body, P.DistributedUpdate):
            await self._guard(False)
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
