"""Tenants: training runs that share one farm, each with its own API tokens, kept hashed in Redis.

  tenants               hash: tenant id -> its record (JSON: name, created, the SHA-256 of each of its tokens)
  tenant-token:<sha256> the tenant id a token belongs to

A token is shown once, when it is made (`farm tenants create`), and only its SHA-256 is kept. The admin token
(FARM_API_TOKEN) is every tenant's and none: it sees and changes everything.

A record changes only inside a WATCH/MULTI transaction on the `tenants` hash (create, set_quota, revoke), retried
when another ingress changed the hash meanwhile: a token made while a quota changes, or while the tenant is revoked,
is never lost nor left working for a revoked tenant.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import WatchError

from rollout_farm.services.errors import STATE_ERRORS, NotFound, Overloaded
from rollout_farm.services.observability import metrics
from rollout_farm.services.tenants.admission import ANONYMOUS, Admission

TENANT_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
RECORDS_TTL_S = 1.0  # how long admission uses the tenants' records it read (quotas change within a second)
TOKEN_PREFIX = "tml-farm-"  # "tml-": a tenant token is a valid key for Tinker's SDK as it is (TINKER_API_KEY)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who sends a request: the admin (tenant None, admin True), a tenant, or nobody (an open route, no token)."""

    tenant: str | None = None
    admin: bool = False

    def may_use(self, owner: str | None) -> bool:
        """Whether this caller may read or use what `owner` (a tenant id; None: the admin) owns."""
        return self.admin or owner is None or owner == self.tenant

    def may_change(self, owner: str | None) -> bool:
        return self.admin or (owner is not None and owner == self.tenant)


ANYONE = Principal()  # a caller without a token: the base model and the admin's adapters and sessions
ADMIN = Principal(admin=True)  # the admin token, and the farm's own calls (episodes run in the farm)


class Tenants:
    def __init__(self, r: Redis, prefix: str, fair_capacity: int = 0):
        self.r, self.key, self.prefix = r, f"{prefix}:tenants", prefix
        self.admission = Admission(r, prefix, fair_capacity)
        self._cache: tuple[float, dict[str, dict]] = (-1e9, {})  # (when read, tenant -> record)

    def _token_key(self, digest: str) -> str:
        return f"{self.prefix}:tenant-token:{digest}"

    async def create(self, tenant: str) -> tuple[dict, str]:
        """A new tenant (or a new token for an existing one): its record and the token, shown this once."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        digest = token_hash(token)

        def add(record: dict | None) -> dict:
            record = record or {"tenant": tenant, "created": time.time(), "tokens": []}
            record["tokens"].append(digest)
            return record

        record = await self._change(tenant, add, lambda pipe: pipe.set(self._token_key(digest), tenant))
        return record, token

    async def _change(self, tenant: str, change, also=lambda pipe: None) -> dict:
        """The tenant's record changed by change(record or None) -> record, and also(pipe) queued with it, in one
        transaction; run again when the hash changed meanwhile (a read-modify-write never loses another's change)."""
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(self.key)
                    raw = await pipe.hget(self.key, tenant)
                    record = change(json.loads(raw) if raw else None)
                    pipe.multi()
                    pipe.hset(self.key, tenant, json.dumps(record))
                    also(pipe)
                    await pipe.execute()
                    return record
                except WatchError:
                    continue

    async def all(self) -> list[dict]:
        return [json.loads(v) for _, v in sorted((await self.r.hgetall(self.key)).items())]

    async def revoke(self, tenant: str) -> dict:
        """Every token of the tenant stops working at once; its adapters stay (the admin may retire them)."""
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(self.key)
                    raw = await pipe.hget(self.key, tenant)
                    record = known(tenant, json.loads(raw) if raw else None)
                    pipe.multi()
                    for digest in record["tokens"]:
                        pipe.delete(self._token_key(digest))
                    pipe.hdel(self.key, tenant)
                    await pipe.execute()
                    return record
                except WatchError:
                    continue

    async def set_quota(self, tenant: str, quota: dict) -> dict:
        def change(record: dict | None) -> dict:
            return {**known(tenant, record), "quota": quota}

        record = await self._change(tenant, change)
        self._cache = (-1e9, {})  # this ingress applies it now; the others within RECORDS_TTL_S
        return record

    async def _records(self, tenant: str | None) -> dict[str, dict]:
        """Every tenant's record, read at most once a second (at once for a tenant not read yet); the last ones read
        while Redis does not answer."""
        at, records = self._cache
        if time.monotonic() - at > RECORDS_TTL_S or (tenant is not None and tenant not in records):
            try:
                records = {t["tenant"]: t for t in await self.all()}
                self._cache = (time.monotonic(), records)
            except STATE_ERRORS:
                pass
        return records

    @contextlib.asynccontextmanager
    async def admitted(self, who: Principal, samples: int):
        """Within: the request's `samples` count against its tenant's quota and fair share (admission.py); a 429
        naming the tenant when they are used up. Yields a callback that takes the tokens the request generated.
        Without tenants the farm admits as before tenants (no count, no Redis); when Redis does not answer, the
        admin's and open requests go on uncounted (a tenant's token could not be read either: its request is a 503
        already)."""
        records = await self._records(who.tenant)
        name = who.tenant or ANONYMOUS
        quota = (records.get(who.tenant) or {}).get("quota") or {}
        weights = {t: float((r.get("quota") or {}).get("weight", 1.0)) for t, r in records.items()}
        async with contextlib.AsyncExitStack() as stack:
            spent = None
            if records:
                try:
                    counted = self.admission.admitted(who.tenant, samples, quota, {**weights, ANONYMOUS: 1.0})
                    spent = await stack.enter_async_context(counted)
                except Overloaded:
                    metrics.TENANT_ADMISSIONS.labels(name, "refused").inc()
                    raise
                except STATE_ERRORS:
                    if who.tenant:
                        raise
            metrics.TENANT_ADMISSIONS.labels(name, "admitted").inc()

            def took(tokens: int) -> None:
                metrics.TENANT_TOKENS.labels(name).inc(tokens)
                if spent is not None:
                    spent(tokens)

            yield took

    async def of_token(self, token: str) -> str | None:
        """The tenant a token belongs to; None when it is nobody's."""
        return await self.r.get(self._token_key(token_hash(token)))


def known(tenant: str, record: dict | None) -> dict:
    """The tenant's record; 404 when there is none."""
    if record is None:
        raise NotFound(f"no tenant {tenant!r}: GET /v1/tenants lists them", [{"field": "tenant", "message": "unknown"}])
    return record
