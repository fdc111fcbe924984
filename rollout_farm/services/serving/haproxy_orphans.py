"""Ending the haproxy that Ray Serve ran for this node, once `farm serve` has stopped Serve and Ray.

With FARM_HTTP_PROXY=haproxy (the default), Serve's HAProxy manager actor runs an haproxy process and ends it when
Serve shuts down. When Serve's controller does not finish its shutdown within serve.shutdown()'s 30 s (replicas still
draining in-flight requests), ray.shutdown() kills that actor first, and its haproxy lives on as an orphan (PPID 1)
that still holds FARM_PORT: the next `farm serve` on that port cannot bind it. The manager writes its config under
/tmp/haproxy-serve/<node id>/ (the folder of RAY_SERVE_HAPROXY_CONFIG_FILE_LOC, one per node), so the haproxy
processes started with a config there are this node's, never those of another service on the machine (each local
Ray cluster is a node of its own, with its own id).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import psutil

SERVE_CONFIG = "/tmp/haproxy-serve/haproxy.cfg"  # Ray Serve's default RAY_SERVE_HAPROXY_CONFIG_FILE_LOC
GRACE_S = 5.0  # after SIGTERM (haproxy -db stops at once), before SIGKILL


def config_folder(node_id: str) -> Path:
    """The folder of this node's haproxy config, as Serve's HAProxy manager names it."""
    return Path(os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC") or SERVE_CONFIG).parent / node_id


def node_haproxies(node_id: str) -> list[psutil.Process]:
    """The running haproxy processes whose config (-f FILE) lies in this node's folder."""
    folder = config_folder(node_id)
    found = []
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        args = p.info["cmdline"] or []
        if p.info["name"] != "haproxy" or p.info["status"] == psutil.STATUS_ZOMBIE or "-f" not in args[:-1]:
            continue
        if Path(args[args.index("-f") + 1]).parent == folder:
            found.append(p)
    return found


def running(p: psutil.Process) -> bool:
    """Still running: an ended process whose parent has not reaped it yet (a zombie) is not."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def end_node_haproxies(node_id: str) -> list[int]:
    """SIGTERM this node's haproxy processes, SIGKILL those still running after GRACE_S; returns their pids."""
    procs = node_haproxies(node_id)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return [p.pid for p in procs]
