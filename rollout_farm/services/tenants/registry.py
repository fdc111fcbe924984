"""Tenants: training runs that share one farm, each with its own API tokens, kept hashed in Redis.

  tenants               hash: tenant id -> its record (JSON: name, created, the SHA-256 of each of its tokens)
  tenant-token:<sha256> the tenant id a token belongs to

A token is shown once, when it is made (`farm tenants create`), and only its SHA-256 is kept. The admin token
(FARM_API_TOKEN) is every tenant's and none: it sees and changes everything.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from rollout_farm.services.errors import Invalid, NotFound

TENANT_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
TOKEN_PREFIX = "farm-"


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


class Tenants:
    def __init__(self, r: Redis, prefix: str):
        self.r, self.key, self.prefix = r, f"{prefix}:tenants", prefix

    def _token_key(self, digest: str) -> str:
        return f"{self.prefix}:tenant-token:{digest}"

    async def create(self, tenant: str) -> tuple[dict, str]:
        """A new tenant (or a new token for an existing one): its record and the token, shown this once."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        digest = token_hash(token)
        raw = await self.r.hget(self.key, tenant)
        record = json.loads(raw) if raw else {"tenant": tenant, "created": time.time(), "tokens": []}
        record["tokens"].append(digest)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.key, tenant, json.dumps(record))
        pipe.set(self._token_key(digest), tenant)
        await pipe.execute()
        return record, token

    async def all(self) -> list[dict]:
        return [json.loads(v) for _, v in sorted((await self.r.hgetall(self.key)).items())]

    async def revoke(self, tenant: str) -> dict:
        """Every token of the tenant stops working at once; its adapters stay (the admin may retire them)."""
        raw = await self.r.hget(self.key, tenant)
        if raw is None:
            raise NotFound(
                f"no tenant {tenant!r}: GET /v1/tenants lists them", [{"field": "tenant", "message": "unknown"}]
            )
        record = json.loads(raw)
        pipe = self.r.pipeline(transaction=True)
        for digest in record["tokens"]:
            pipe.delete(self._token_key(digest))
        pipe.hdel(self.key, tenant)
        await pipe.execute()
        return record

    async def of_token(self, token: str) -> str | None:
        """The tenant a token belongs to; None when it is nobody's."""
        return await self.r.get(self._token_key(token_hash(token)))


def checked_id(tenant: str) -> str:
    if not TENANT_ID.match(tenant):
        raise Invalid(
            [{"field": "tenant", "message": "not a tenant id"}],
            f"tenant id {tenant!r} is not lower-case letters, digits and '-' (1-63, starting with a letter or digit)",
        )
    return tenant
