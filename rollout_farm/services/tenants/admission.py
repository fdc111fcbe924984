"""Per-tenant admission at the ingress: quotas, and weighted-fair shares of a busy farm.

Each tenant may have a quota (`PUT /v1/tenants/{tenant}/quota`): at most `in_flight_samples` samples generating at
once, at most `tokens_per_s` generated tokens per second (a token bucket holding one second's worth: a request is
admitted while the bucket is not in debt, and its tokens are taken when it ends), and a `weight` (default 1).

Fair shares: while the farm is busy (the samples in flight, all tenants together, at or above FARM_FAIR_SHARE_SAMPLES),
a tenant is admitted only up to its weighted share of that capacity, weight / (sum of the weights of the tenants
with samples in flight). So one heavy tenant cannot starve the others: a light tenant's request is admitted while
the heavy one's wait. Requests without a tenant (the admin's, or open routes) count as the tenant "-" of weight 1.

A refusal is a 429 naming the tenant, the limit and the wait (`Retry-After`). The counts are in Redis, so every ingress
replica admits against the same numbers; each in-flight entry carries a deadline, so one whose ingress died lapses.

  tenant-load:<tenant>   zset: one member per running request ("<id>:<samples>"), scored by its deadline
  tenant-tokens:<tenant> hash: the token bucket (level, time of the last refill)
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from contextlib import asynccontextmanager

from redis.asyncio import Redis

from rollout_farm.services.errors import Overloaded

ANONYMOUS = "-"
LEASE_S = 3600.0  # an in-flight entry's deadline: far past any request, only for an ingress that died mid-request

# KEYS: the tenant's load zset, then every active tenant's; ARGV: now, new entry, its samples, its deadline, quota,
# fair capacity, this tenant's weight, then the other tenants' weights (one per key after the first)
ADMIT = """
local now = tonumber(ARGV[1])
local function load(key)
  redis.call('zremrangebyscore', key, '-inf', now)
  local total = 0
  for _, m in ipairs(redis.call('zrange', key, 0, -1)) do
    total = total + tonumber(string.match(m, ':(%d+)$'))
  end
  return total
end
local mine = load(KEYS[1])
local want = tonumber(ARGV[3])
local quota = tonumber(ARGV[5])
if quota > 0 and mine + want > quota and mine > 0 then
  return {0, mine, 0}
end
local capacity = tonumber(ARGV[6])
local all, weights = mine, tonumber(ARGV[7])
for i = 2, #KEYS do
  local other = load(KEYS[i])
  all = all + other
  if other > 0 then weights = weights + tonumber(ARGV[6 + i]) end
end
if capacity > 0 and all + want > capacity and mine > 0 then
  local share = capacity * tonumber(ARGV[7]) / weights
  if mine + want > share then
    return {0, mine, math.floor(share)}
  end
end
redis.call('zadd', KEYS[1], ARGV[4], ARGV[2])
return {1, mine, 0}
"""


class Admission:
    def __init__(self, r: Redis, prefix: str, fair_capacity: int):
        self.r, self.prefix, self.capacity = r, prefix, fair_capacity
        self._admit = r.register_script(ADMIT)

    def _load_key(self, tenant: str) -> str:
        return f"{self.prefix}:tenant-load:{tenant}"

    def _bucket_key(self, tenant: str) -> str:
        return f"{self.prefix}:tenant-tokens:{tenant}"

    @asynccontextmanager
    async def admitted(self, tenant: str | None, samples: int, quota: dict, weights: dict[str, float]):
        """Within: `samples` samples of `tenant` count as in flight. Overloaded (429, naming the tenant) when its
        quota or its fair share of a busy farm is used up, or its token bucket is in debt. Yields a callback that
        takes the tokens the request generated."""
        tenant = tenant or ANONYMOUS
        rate = quota.get("tokens_per_s") or 0
        if rate:
            wait = await self._bucket_wait(tenant, rate)
            if wait > 0:
                raise refused(tenant, f"its {rate} tokens/s are used up", wait)
        others = [t for t in weights if t != tenant]
        member, now = f"{uuid.uuid4().hex}:{samples}", time.time()
        keys = [self._load_key(tenant), *map(self._load_key, others)]
        args = [now, member, samples, now + LEASE_S, quota.get("in_flight_samples") or 0, self.capacity]
        args += [weights.get(tenant, 1.0), *(weights[t] for t in others)]
        ok, mine, share = await self._admit(keys=keys, args=args)
        if not ok:
            limit = f"its fair share ({share} samples) of a busy farm" if share else "its in-flight quota"
            raise refused(tenant, f"{mine} of its samples are in flight, at {limit}", 1.0)
        spent = []
        try:
            yield spent.append
        finally:
            # shielded: a streamed answer's caller that leaves cancels this cleanup, which must still run
            await asyncio.shield(self.r.zrem(keys[0], member))
            if rate and spent:
                await asyncio.shield(self._take(tenant, rate, sum(spent)))

    async def _bucket_wait(self, tenant: str, rate: float) -> float:
        """Seconds until the tenant's token bucket is out of debt (0: not in debt)."""
        level, at = await self.r.hmget(self._bucket_key(tenant), "level", "at")
        if level is None:
            return 0.0
        now = time.time()
        level = min(rate, float(level) + (now - float(at)) * rate)
        return 0.0 if level >= 0 else -level / rate

    async def _take(self, tenant: str, rate: float, tokens: int) -> None:
        key, now = self._bucket_key(tenant), time.time()
        level, at = await self.r.hmget(key, "level", "at")
        level = rate if level is None else min(rate, float(level) + (now - float(at)) * rate)
        await self.r.hset(key, mapping={"level": level - tokens, "at": now})


def refused(tenant: str, why: str, wait_s: float) -> Overloaded:
    error = Overloaded(
        f"tenant {tenant!r}: {why}; retry after {math.ceil(wait_s)} s",
        [{"field": "tenant", "message": tenant}],
    )
    error.retry_after_s = max(1, math.ceil(wait_s))
    return error
