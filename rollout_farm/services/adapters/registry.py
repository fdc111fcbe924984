"""The adapters' records in Redis, shared by every ingress replica: who owns each adapter, its versions (immutable:
a version is never reused for other bytes) and which of them are resident.

  adapters                 set: every adapter name
  adapter:<name>           hash: "owner" (a tenant id, "" for the admin), and per version "v<N>": its record (JSON)
  adapter:<name>:v<N>:bytes hash: the version's "config" (JSON) and "body" (its safetensors bytes, as they are), kept
                           while it is resident, so that a replica that starts (or unloaded it) loads it again before
                           it serves it; written during the push with a TTL (UNRECORDED_TTL_S), which record() lifts

The resident window: each adapter's last FARM_ADAPTER_VERSIONS_RESIDENT versions. A request may name any version in
it; one that has left it, or was never pushed, is a 409 naming the window. A replica keeps a version loaded while a
call uses it (pinned: rollout_farm/services/engine/torch/lora.py), even once it has left the window. Within the window,
a replica keeps at most FARM_ADAPTER_BYTES_PER_REPLICA bytes loaded (residency.py) and loads the others from their
bodies here when a request names them.
"""

from __future__ import annotations

import json
import time

from redis.asyncio import Redis

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import Conflict, NotFound
from rollout_farm.services.tenants.registry import Principal

RESIDENT, EVICTED = "resident", "evicted"

UNRECORDED_TTL_S = 3600  # a stored body whose push never recorded it (its ingress died) lapses


def not_found(name: str) -> NotFound:
    return NotFound(
        f"adapter {name!r} is unknown: push it first (POST /v1/adapters/{name}?version=1); GET /v1/adapters lists "
        "those you may use",
        [{"field": "adapter.name", "message": "no such adapter"}],
    )


class AdapterRegistry:
    def __init__(self, r: Redis, prefix: str, resident_versions: int):
        self.r, self.prefix, self.window = r, prefix, resident_versions

    def _key(self, name: str) -> str:
        return f"{self.prefix}:adapter:{name}"

    def _body_key(self, name: str, version: int) -> str:
        return f"{self.prefix}:adapter:{name}:v{version}:bytes"

    async def info(self, name: str) -> P.AdapterInfo | None:
        raw = await self.r.hgetall(self._key(name))
        if not raw:
            return None
        versions = sorted(
            (P.AdapterVersion(**json.loads(v)) for k, v in raw.items() if k.startswith("v")), key=lambda v: v.version
        )
        return P.AdapterInfo(name=name, owner=raw.get("owner") or None, versions=versions)

    async def visible(self, name: str, who: Principal) -> P.AdapterInfo | None:
        """The adapter's record when `who` may use it; None when it is unknown or another tenant's (no difference is
        told)."""
        info = await self.info(name)
        return info if info is not None and who.may_use(info.owner) else None

    async def all(self) -> list[P.AdapterInfo]:
        names = sorted(await self.r.smembers(f"{self.prefix}:adapters"))
        return [info for info in [await self.info(n) for n in names] if info is not None]

    async def claim(self, name: str, owner: str | None) -> P.AdapterInfo | None:
        """The adapter's record, after creating it for `owner` when it is new."""
        await self.r.hsetnx(self._key(name), "owner", owner or "")
        await self.r.sadd(f"{self.prefix}:adapters", name)
        return await self.info(name)

    async def store_body(self, name: str, version: int, config_json: str, body: bytes) -> None:
        """A version's config and bytes, for the replicas that load it later; written while the replicas stage it
        (record() makes it a version; drop_body() undoes this for a push that fails)."""
        async with self.r.pipeline(transaction=True) as pipe:  # a push that dies before record() leaves nothing
            pipe.hset(self._body_key(name, version), mapping={"config": config_json, "body": body})
            pipe.expire(self._body_key(name, version), UNRECORDED_TTL_S)
            await pipe.execute()

    async def drop_body(self, name: str, version: int) -> None:
        await self.r.delete(self._body_key(name, version))

    async def record(self, name: str, version: P.AdapterVersion) -> list[int]:
        """A committed version (its body stored), resident; the versions that leave the window (evicted: their
        bodies deleted)."""
        info = await self.info(name)
        resident = [v.version for v in info.versions if v.state == RESIDENT] if info else []
        out = sorted({*resident, version.version})
        evicted = out[: max(0, len(out) - self.window)]
        pipe = self.r.pipeline(transaction=True)
        pipe.persist(self._body_key(name, version.version))
        pipe.hset(self._key(name), f"v{version.version}", version.model_dump_json())
        for v in evicted:
            old = next(x for x in [*(info.versions if info else []), version] if x.version == v)
            pipe.hset(self._key(name), f"v{v}", old.model_copy(update={"state": EVICTED}).model_dump_json())
            pipe.delete(self._body_key(name, v))
        await pipe.execute()
        return evicted

    async def retire(self, name: str) -> list[int]:
        """Every version evicted (DELETE, or a forced base push); the record stays, so no version is ever reused."""
        info = await self.info(name)
        if info is None:
            return []
        gone = [v.version for v in info.versions if v.state == RESIDENT]
        pipe = self.r.pipeline(transaction=True)
        for v in info.versions:
            if v.state == RESIDENT:
                pipe.hset(self._key(name), f"v{v.version}", v.model_copy(update={"state": EVICTED}).model_dump_json())
                pipe.delete(self._body_key(name, v.version))
        await pipe.execute()
        return gone

    async def resident_any(self) -> dict[str, list[int]]:
        """name -> resident versions, of every adapter with one."""
        out = {}
        for info in await self.all():
            if versions := [v.version for v in info.versions if v.state == RESIDENT]:
                out[info.name] = versions
        return out

    async def resolve(self, ref: P.AdapterRef) -> P.AdapterVersion:
        """The resident version `ref` names: NotFound for an unknown adapter; Conflict, naming the resident window,
        for a version outside it."""
        info = await self.info(ref.name)
        if info is None:
            raise not_found(ref.name)
        resident = [v for v in info.versions if v.state == RESIDENT]
        window = (
            f"resident versions of {ref.name!r}: v{resident[0].version}..v{resident[-1].version}"
            if resident
            else f"{ref.name!r} has no resident version (retired): push a new one"
        )
        if ref.version is not None:
            hit = next((v for v in resident if v.version == ref.version), None)
            if hit is None:
                known = any(v.version == ref.version for v in info.versions)
                why = "was evicted (it left the resident window)" if known else "was never pushed"
                raise Conflict(
                    f"version {ref.version} of adapter {ref.name!r} {why}; {window} (oldest first)",
                    [{"field": "adapter.version", "message": f"not resident; {window}"}],
                )
            return hit
        floor = ref.min_version or 1
        if not resident or resident[-1].version < floor:
            raise Conflict(
                f"adapter {ref.name!r} has no resident version >= {floor}; {window}",
                [{"field": "adapter.min_version", "message": f"none resident at or above it; {window}"}],
            )
        return resident[-1]


def version_record(version: int, digest: str, base_version: int, sha256: str, size: int, r: int) -> P.AdapterVersion:
    return P.AdapterVersion(
        version=version,
        digest=digest,
        base_version=base_version,
        sha256=sha256,
        bytes=size,
        r=r,
        state=RESIDENT,
        pushed_at=time.time(),
    )
