"""The control-plane state's Redis: the client every ingress replica (and the weight store) uses, its keys, and a
small owner lease for work that exactly one ingress replica must do.

Keys live under `farm:<app name>:` (FARM_APP_NAME), so two apps can share one Redis:
  weights           hash: the committed version, and where its weights are (rollout_farm/services/weights/store.py)
  policy            hash: the trainer's last policy stats (rollout_farm/services/rollout/policy_stats.py)
  job:<request_id>  a rollout's idempotency record (rollout_farm/services/rollout/jobs.py)
  q:...             the trajectory queue (rollout_farm/services/queue/trajectory_queue.py)
"""

from __future__ import annotations

import uuid

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry  # not redis.retry's: on an asyncio client that one retries nothing
from redis.backoff import ExponentialBackoff

MAX_CONNECTIONS = 1024  # per ingress replica; made as needed (redis-server takes 10,000 clients by default)


def connect(url: str, max_connections: int = MAX_CONNECTIONS) -> aioredis.Redis:
    """An asyncio client that retries a dropped connection briefly (capped backoff) before raising. Its pool makes up
    to max_connections as commands need them: a burst of episodes (each a session) runs as many commands at once,
    and redis-py's default of 100 failed a group of 128 with MaxConnectionsError. (Not redis-py's blocking pool: its
    asyncio.Condition belongs to one event loop, and Serve runs the ingress's code on more than one.)"""
    return aioredis.Redis.from_url(
        url,
        max_connections=max_connections,
        decode_responses=True,
        socket_connect_timeout=2,
        socket_timeout=10,
        health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


def prefix(app_name: str) -> str:
    return f"farm:{app_name}"


EXTEND = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class Owner:
    """This ingress replica's claim on a key, kept alive by extend(); it lapses ttl_ms after its holder dies."""

    def __init__(self, r: aioredis.Redis, ttl_ms: int = 5000):
        self.r, self.ttl_ms, self.me = r, ttl_ms, uuid.uuid4().hex
        self._extend, self._release = r.register_script(EXTEND), r.register_script(RELEASE)

    async def claim(self, key: str) -> bool:
        return bool(await self.r.set(key, self.me, nx=True, px=self.ttl_ms))

    async def extend(self, key: str) -> bool:
        """True while this replica still holds `key`."""
        return bool(await self._extend(keys=[key], args=[self.me, self.ttl_ms]))

    async def release(self, key: str) -> None:
        await self._release(keys=[key], args=[self.me])

    async def holds(self, key: str) -> bool:
        return await self.r.get(key) == self.me


def binary(r: aioredis.Redis) -> aioredis.Redis:
    """A client like `r` (same server, settings and retries) whose replies are bytes, not text: for packed values
    (a session's token columns, rollout_farm/services/episodes/session_store.py). Its own pool: a transaction runs
    on one client's connection."""
    pool = r.connection_pool
    kwargs = {**pool.connection_kwargs, "decode_responses": False}
    return aioredis.Redis(
        connection_pool=type(pool)(
            connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs
        )
    )
