"""Adapter pushes at the ingress: checked, then two phases over every replica, like a weight push
(rollout_farm/services/weights/push.py), one push per adapter at a time.

  read     the body (one safetensors file, adapter_config.json in its __metadata__; or a peft folder by path),
           bounded by FARM_MAX_WEIGHTS_BYTES; its header and config checked before any replica sees it
  version  `name@vN` is immutable: the same bytes again answer with the first push's record; other bytes are a 409;
           versions only go up
  stage    every replica checks the adapter against the served model and computes its policy digest from the bytes
           it loaded; any refusal, or two replicas with different digests (different base weights): all discard.
           Meanwhile Redis stores its bytes, kept while it is resident for replicas that load it later
  record   Redis keeps the version
  commit   one call per replica: it makes the version resident, and retires the versions that left the resident
           window (unloaded once no call uses them)

Each push logs `adapter_pushed` with the seconds of its phases (checks, stage, record, commit).

Once its body is read, a push runs to its end even if its caller goes away (as a weight push does): a push cut
between its phases would leave staged copies behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import pathlib
import time
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from rollout_farm.services import protocol as P
from rollout_farm.services.adapters.peft_format import AdapterInvalid, module_pairs, read_config
from rollout_farm.services.adapters.registry import AdapterRegistry, not_found, version_record
from rollout_farm.services.client.peft_files import CONFIG_META, PROBE_META, folder_files
from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.errors import Conflict, Forbidden, Invalid, ReplicasFailed, ServiceError, TooLarge
from rollout_farm.services.tenants.registry import Principal
from rollout_farm.services.weights import probe as probes
from rollout_farm.services.weights.checks import WeightsError, parse_header
from rollout_farm.services.weights.push import run_to_end

SYNC = "FARM_WEIGHT_SYNC_TIMEOUT_S"
log = logging.getLogger("farm.service")


def header_of(body: bytes) -> tuple[dict, dict]:
    """(name -> (shape, dtype), __metadata__) of a one-file safetensors body; Invalid naming `adapter_model`."""
    try:
        if len(body) < 8:
            raise WeightsError(["the body is not a safetensors file (shorter than its 8-byte header length)"])
        n = int.from_bytes(body[:8], "little")
        if n > len(body) - 8:
            raise WeightsError([f"the header says {n} bytes but only {len(body) - 8} follow: the upload was cut"])
        spec, offsets, metadata = parse_header(body[8 : 8 + n], len(body) - 8 - n)
    except WeightsError as e:
        raise Invalid([{"field": "adapter_model", "message": p} for p in e.problems]) from None
    return spec, metadata


class AdapterPush:
    def __init__(self, replicas, registry: AdapterRegistry, settings: ServiceSettings, r: Redis, prefix: str):
        """`replicas`: the ingress's handle on the engine replicas (rollout_farm.services.replica.handle.Replicas)."""
        self.replicas, self.registry, self.settings, self.r, self.prefix = replicas, registry, settings, r, prefix
        self.served_name = pathlib.PurePath(settings.model.rstrip("/")).name

    def _lock(self, name: str):
        """One push or retire of `name` at a time, across every ingress replica."""
        return self.r.lock(f"{self.prefix}:adapter:{name}:lock", timeout=self.settings.weight_sync_timeout_s + 60)

    async def upload(self, name: str, version: int, chunks: AsyncIterator[bytes], declared: int, who: Principal):
        limit = self.settings.max_weights_bytes
        too_large = TooLarge(f"adapter upload larger than FARM_MAX_WEIGHTS_BYTES={limit}: raise it, or push by path")
        if declared > limit:
            raise too_large
        parts, size = [], 0
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise too_large
            parts.append(chunk)
        body = b"".join(parts)
        spec, metadata = header_of(body)
        config_json = metadata.get(CONFIG_META)
        if not isinstance(config_json, str):
            raise Invalid(
                [
                    {
                        "field": "adapter_config",
                        "message": f"missing: put adapter_config.json in the safetensors __metadata__ under "
                        f"{CONFIG_META!r} (rollout_farm.services.client.peft_files.upload_body does), "
                        "or push by path",
                    }
                ]
            )
        probe = probes.parse(metadata.get(PROBE_META))
        return await run_to_end(self._push(name, version, body, config_json, spec, who, probe))

    async def from_path(self, name: str, req: P.AdapterFromPath, who: Principal) -> P.AdapterPushResponse:
        """A peft folder inside FARM_WEIGHTS_DIR (a tenant's: inside FARM_WEIGHTS_DIR/<tenant>, so that no tenant
        reads another's folders), read whole within FARM_MAX_WEIGHTS_BYTES."""
        folder = pathlib.Path(req.path).resolve()
        root = self.settings.weights_dir
        if who.tenant and not root:
            raise Forbidden(
                "a tenant pushes an adapter by upload (POST /v1/adapters/{name}): FARM_WEIGHTS_DIR is unset"
            )
        allowed = pathlib.Path(root).resolve() / (who.tenant or "") if root else None
        if allowed is not None and not folder.is_relative_to(allowed):
            raise Invalid([{"field": "path", "message": f"{req.path} is outside {allowed}: push a folder inside it"}])
        try:
            config_file, tensors_file = folder_files(folder)
            if tensors_file.stat().st_size > self.settings.max_weights_bytes:
                raise TooLarge(
                    f"{tensors_file} is larger than FARM_MAX_WEIGHTS_BYTES={self.settings.max_weights_bytes}"
                )
            body, config_json = await asyncio.to_thread(
                lambda: (tensors_file.read_bytes(), config_file.read_text(encoding="utf-8"))
            )
        except AdapterInvalid as e:
            raise Invalid(e.problems) from None
        except (OSError, UnicodeDecodeError) as e:
            raise Invalid([{"field": "path", "message": f"cannot read the adapter's files: {e}"}]) from None
        spec, _ = header_of(body)
        return await run_to_end(self._push(name, req.version, body, config_json, spec, who, probes.parse(req.probe)))

    async def _push(self, name, version, body, config_json, spec, who: Principal, probe) -> P.AdapterPushResponse:
        started = time.monotonic()
        if name.lower() == self.served_name.lower():
            raise Invalid(
                [
                    {
                        "field": "name",
                        "message": f"{name!r} is the served model's name: OpenAI clients asking for the "
                        "base model by it would get the adapter. Choose another name",
                    }
                ]
            )
        try:
            config = read_config(config_json)
            module_pairs(spec)
        except AdapterInvalid as e:
            raise Invalid(e.problems, "the adapter is malformed: fix the named fields") from None
        sha = hashlib.sha256(body + b"\0" + config_json.encode()).hexdigest()  # the tensors and the config
        lock = self._lock(name)
        if not await lock.acquire(blocking_timeout=self.settings.weight_sync_timeout_s):
            raise Conflict(f"another push of adapter {name!r} runs for longer than {SYNC}: retry later")
        try:
            info = await self.registry.claim(name, who.tenant)
            if not who.may_change(info.owner):  # another tenant's (it may have claimed the name meanwhile)
                raise (
                    not_found(name)
                    if not who.may_use(info.owner)
                    else Forbidden(
                        f"adapter {name!r} belongs to the admin: push under another name, or use the admin token"
                    )
                )
            same = next((v for v in info.versions if v.version == version), None)
            if same is not None:
                if same.sha256 == sha and same.state == "resident":
                    return P.AdapterPushResponse(
                        name=name,
                        version=version,
                        digest=same.digest,
                        tensors=len(spec),
                        bytes=len(body),
                        seconds=time.monotonic() - started,
                        again=True,
                    )
                why = "with other bytes" if same.sha256 != sha else "and has been evicted or retired"
                raise Conflict(
                    f"{name}@v{version} was pushed before {why} (sha256 {same.sha256[:12]}...): a version is never "
                    f"reused; push version {info.versions[-1].version + 1}",
                    [{"field": "version", "message": f"already pushed {why}"}],
                )
            if info.versions and version < info.versions[-1].version:
                raise Conflict(
                    f"versions of {name!r} only go up: the newest is {info.versions[-1].version}; push "
                    f"{info.versions[-1].version + 1} or higher",
                    [{"field": "version", "message": "older than the newest version"}],
                )
            key, locked = f"{name}@v{version}", time.monotonic()
            stored = asyncio.ensure_future(self.registry.store_body(name, version, config_json, body))  # meanwhile
            try:
                digest, base = await self._stage(key, config_json, body, probe and probe.model_dump_json())
                staged = time.monotonic()
                await stored
                record = version_record(version, digest, base, sha, len(body), config.r)
                evicted = await self.registry.record(name, record)
            except BaseException:  # refused, timed out or cut: nothing stays staged anywhere, nothing is recorded
                await asyncio.gather(stored, return_exceptions=True)
                await self._discard(key)
                with contextlib.suppress(Exception):  # a body left behind is overwritten by this version's next push
                    await self.registry.drop_body(name, version)
                raise
            # one call: load it, and retire the versions that left the window (a lost replica loads it later)
            recorded, retired = time.monotonic(), [f"{name}@v{v}" for v in evicted]
            if await self.replicas.errors("commit_adapter", key, retired, timeout_s=60.0, setting=SYNC):
                for old in retired:  # a replica whose commit failed still retires them (a no-op where done)
                    await self.replicas.each("retire_adapter", old)
            phases = {"checks_s": locked - started, "stage_s": staged - locked, "record_s": recorded - staged}
            phases["commit_s"] = time.monotonic() - recorded
            log.info("adapter_pushed", extra={"adapter": key, "digest": digest, "evicted": evicted, **phases})
        finally:
            await lock.release()
        return P.AdapterPushResponse(
            name=name,
            version=version,
            digest=digest,
            tensors=len(spec),
            bytes=len(body),
            seconds=time.monotonic() - started,
            evicted=evicted,
        )

    async def _discard(self, key: str) -> None:
        try:
            await self.replicas.each("discard_adapter", key)
        except Exception as e:  # a replica that cannot be reached holds nothing it could serve: it was never committed
            log.warning("adapter_discard_failed", extra={"adapter": key, "error": str(e)})

    async def _stage(self, key: str, config_json: str, body: bytes, probe_json: str | None) -> tuple[str, int]:
        """Stage on every replica (each checks the probe, if any); (their common digest, the oldest base version
        they computed it on), or the refusal is raised (the caller discards)."""
        timeout = self.settings.weight_sync_timeout_s
        results = await self.replicas.each("stage_adapter", key, config_json, body, probe_json, timeout_s=timeout)
        errors = [r for r in results if isinstance(r, Exception)]
        digests = {r[0] for r in results if isinstance(r, tuple)}
        if errors and all(isinstance(e, Invalid) for e in errors):
            raise Invalid(errors[0].detail, errors[0].message)
        if errors:
            raise (
                errors[0]
                if isinstance(errors[0], ServiceError)
                else ReplicasFailed(
                    f"replicas failed to stage {key}; nothing changed",
                    [{"field": "replica", "message": str(errors[0])}],
                )
            )
        if len(digests) != 1:
            raise ReplicasFailed(
                f"the replicas computed different digests for {key} ({sorted(digests)}): they serve different base "
                "weights; nothing changed, retry once GET /v1/weights/version shows one version",
                [{"field": "replica", "message": json.dumps(sorted(digests))}],
            )
        return digests.pop(), min(r[1] for r in results)

    async def guard_base(self, force: bool) -> None:
        """Before a base weight push: 409 while adapters made on the served base are resident (they would be served
        on weights they were not trained on); with force, retire them all first."""
        resident = await self.registry.resident_any()
        if not resident:
            return
        if not force:
            names = ", ".join(f"{n}@v{vs[-1]}" for n, vs in sorted(resident.items())[:5])
            raise Conflict(
                f"LoRA adapters made on the served base are resident ({names}; {len(resident)} in all): a new base "
                "would serve them on weights they were not trained on. Retire them (DELETE /v1/adapters/{name}) or "
                "push with force=true, which retires them",
                [{"field": "force", "message": "adapters are resident on the served base"}],
            )
        for name in resident:
            await self.retire(name)

    async def retire(self, name: str) -> list[int]:
        """Every resident version retired (under the adapter's push lock: a push never lands after it)."""
        lock = self._lock(name)
        if not await lock.acquire(blocking_timeout=self.settings.weight_sync_timeout_s):
            raise Conflict(f"a push of adapter {name!r} runs for longer than {SYNC}: retry later")
        try:
            gone = await self.registry.retire(name)
            for v in gone:
                await self.replicas.each("retire_adapter", f"{name}@v{v}")
        finally:
            await lock.release()
        return gone
