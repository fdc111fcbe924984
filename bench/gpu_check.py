"""The GPU path, checked on a machine with one GPU (or more) and the GPU extras: run by bench/gpu_check.sh.

Each check prints one line, `PASS|FAIL|SKIP <check> <figure or reason>`. The checks run in two phases, each a child
process (bench/gpu_check_phases.py) that starts the farm on SGLang under Ray Serve, runs its checks and stops it:

    half   serve_half, rollout_half                  two engine replicas at 0.5 GPU each
    full   serve_full, rollout, session_turn,        one engine replica on the whole GPU
           trainer_step, push_path, push_nccl

The child announces each check (`BEGIN <check>`) and its result (`RESULT <json>`) on a pipe of their own, the file
descriptor in $GPU_CHECK_FD, so that nothing Ray or SGLang print can split a line; its stdout and stderr go to the
phase's log under bench/results/gpu_check/. This process holds each check to its own timeout: a check that overruns
is a FAIL, its phase is stopped (SIGTERM, then SIGKILL to the process group) and the phase's remaining checks are
SKIPs. The timeouts, with a phase's stop, sum to under 10 minutes (TOTAL_S).

Without a GPU, or without the GPU extra's packages, it prints one SKIP line naming the reason and exits 0. It exits
1 when a check failed. Not part of `make test`; tests/unit/test_gpu_check.py checks the selection, the lines, the
timeouts (on stand-in children) and the skip.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "bench" / "results" / "gpu_check"  # git-ignored
PROTOCOL_FD = "GPU_CHECK_FD"  # the environment variable naming the child's end of the protocol pipe
STOP_S = 20  # after a phase's last result: its service stopping (serve.shutdown, ray.shutdown)
TOTAL_S = 570  # every check's timeout and each phase's STOP_S together, at most: 10 minutes less the start
GPU_EXTRA = ("torch", "ray", "sglang")  # what the checks need: pip install -e '.[sglang]' (trainer_step: '.[trainer]')


@dataclass(frozen=True)
class Check:
    name: str
    phase: str
    timeout_s: float
    what: str


CHECKS = [
    Check("serve_half", "half", 165, "the farm on SGLang, 2 engine replicas at 0.5 GPU each: both answer"),
    Check("rollout_half", "half", 30, "a rollout on the shared GPU: 8 prompts x 4 samples, logprobs finite"),
    Check("serve_full", "full", 120, "the farm on SGLang, 1 engine replica on the whole GPU"),
    Check("rollout", "full", 30, "a rollout; how many tokens two identical greedy rollouts share"),
    Check("session_turn", "full", 30, "two turns of a token session: the second's prompt holds the first turn"),
    Check("trainer_step", "full", 70, "one batch, the trainer's step on CUDA and on the CPU: losses and grad norm"),
    Check("push_path", "full", 40, "push by path (/v1/weights/path): served, greedy tokens change"),
    Check("push_nccl", "full", 45, "push by torch.distributed (/v1/weights/distributed): served, tokens change"),
]
PHASES = ("half", "full")


@dataclass(frozen=True)
class Result:
    status: str  # PASS, FAIL or SKIP
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status} {self.name:<13} {self.detail}"


def worst_case_s(checks: list[Check]) -> float:
    """The longest the checks can take: every timeout, and each phase's stop."""
    return sum(c.timeout_s for c in checks) + STOP_S * len({c.phase for c in checks})


def select(only: list[str] | None) -> list[Check]:
    """The checks `only` names (all when None), in run order, each phase's serve check with them (the others need
    the service it starts). An unknown name is a ValueError naming the valid ones."""
    names = {c.name for c in CHECKS}
    if only is None:
        return list(CHECKS)
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(f"unknown check {', '.join(unknown)}: choose from {', '.join(c.name for c in CHECKS)}")
    phases = {c.phase for c in CHECKS if c.name in only}
    return [c for c in CHECKS if c.name in only or (c.phase in phases and c.name.startswith("serve_"))]


def why_skip(cuda: str | None, gpus: int, have: Callable[[str], bool]) -> str | None:
    """Why the checks cannot run here, or None: `cuda` is torch.version.cuda (None: a CPU build), `gpus` the devices
    torch sees, `have(module)` whether a module is installed."""
    missing = [m for m in GPU_EXTRA if not have(m)]
    if "torch" in missing:
        return "no torch: the GPU extra is missing (pip install -e '.[sglang]')"
    if cuda is None:
        return "no GPU: torch is a CPU build (CUDA torch comes with the GPU image, or pip install -e '.[sglang]')"
    if gpus == 0:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "no GPU: torch sees no CUDA device" + (f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else "")
    if missing:
        return f"the GPU extra is missing: no {', '.join(missing)} (pip install -e '.[sglang]')"
    return None


def preflight() -> str | None:
    """why_skip for this machine (imports torch only when it is installed)."""
    have = lambda m: importlib.util.find_spec(m) is not None  # noqa: E731
    if not have("torch"):
        return why_skip(None, 0, have)
    import torch

    return why_skip(torch.version.cuda, torch.cuda.device_count() if torch.version.cuda else 0, have)


def run_phase(cmd: list[str], checks: list[Check], log: Path, show: Callable[[Result], None] = print) -> list[Result]:
    """Run one phase's child `cmd`, its output in `log`, holding each of `checks` to its timeout. Each result is
    passed to `show` as it comes; checks the child never reported become a FAIL (the one running) and SKIPs."""
    log.parent.mkdir(parents=True, exist_ok=True)
    read, write = os.pipe()
    with open(log, "w") as out:
        env = {**os.environ, PROTOCOL_FD: str(write)}
        kw = dict(stdout=out, stderr=subprocess.STDOUT, pass_fds=(write,), env=env, start_new_session=True)
        child = subprocess.Popen(cmd, **kw)
        os.close(write)  # the child's alone: the pipe ends when it exits
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(os.fdopen(read), lines), daemon=True).start()
        results, running, why = _follow(child, lines, checks, show)
    return results + _unreported(checks, results, running, f"{why}; see {log}", show)


def _follow(
    child: subprocess.Popen, lines: queue.Queue, checks: list[Check], show: Callable[[Result], None]
) -> tuple[list[Result], str | None, str]:
    """Read the child's protocol lines until it ends, or overruns: a check's timeout from its BEGIN (the first
    check's from the start), STOP_S after a result (for the next BEGIN, or the stop after the last). Returns the
    results, the check running at the end (None between checks) and why the phase ended."""
    timeout = {c.name: c.timeout_s for c in checks}
    results: list[Result] = []
    running, deadline = checks[0].name, time.monotonic() + checks[0].timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            _stop(child)
            if running:
                return results, running, f"over its {timeout[running]:g} s timeout"
            if len(results) < len(checks):
                return results, None, f"no next check within {STOP_S} s"
            results.append(Result("FAIL", "stop", f"the service did not stop within {STOP_S} s: killed"))
            show(results[-1])
            return results, None, ""
        if line is None:  # the child ended
            return results, running, f"the phase ended without its result (exit code {child.wait()})"
        kind, _, rest = line.partition(" ")
        if kind == "BEGIN":
            running, deadline = rest, time.monotonic() + timeout[rest]
        elif kind == "RESULT":
            results.append(Result(**json.loads(rest)))
            show(results[-1])
            running, deadline = None, time.monotonic() + STOP_S


def _pump(stream, lines: queue.Queue) -> None:
    """The protocol pipe's lines to `lines`, then None when it ends."""
    with stream:
        for line in stream:
            lines.put(line.rstrip("\n"))
    lines.put(None)


def _stop(child: subprocess.Popen) -> None:
    """SIGTERM to the child's process group, SIGKILL after STOP_S (the child started Ray and SGLang's processes)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(STOP_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _unreported(
    checks: list[Check], results: list[Result], running: str | None, why: str, show: Callable[[Result], None]
) -> list[Result]:
    """A FAIL for the check that was running when the phase ended (or the next one, between checks), a SKIP for each
    check after it."""
    done = {r.name for r in results}
    left = [c for c in checks if c.name not in done]
    running = running or (left[0].name if left else None)
    out = []
    for c in left:
        out.append(Result("FAIL", c.name, why) if c.name == running else Result("SKIP", c.name, f"not run: {why}"))
        show(out[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    listed = "\n".join(f"  {c.name:<13} {c.timeout_s:>4.0f} s  {c.what}" for c in CHECKS)
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"checks, in run order, with their timeouts:\n{listed}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny (default: a random 2-layer Llama, head_dim 64, built in seconds), arith-tiny (the embedded "
        "default, head_dim 32: build it first with `farm build-model`, or its 2 minutes count in serve_half's "
        "timeout), smollm2 (bench/common.py: needs gguf and the network the first time) or an HF model folder",
    )
    ap.add_argument("--only", help=f"comma-separated checks, of: {', '.join(c.name for c in CHECKS)}")
    args = ap.parse_args(argv)
    try:
        checks = select(args.only.split(",") if args.only else None)
    except ValueError as e:
        ap.error(str(e))
    if why := preflight():
        print(Result("SKIP", "gpu_check", why).line(), flush=True)
        return 0
    began, results = time.monotonic(), []
    for phase in PHASES:
        mine = [c for c in checks if c.phase == phase]
        if mine:
            cmd = [sys.executable, str(ROOT / "bench" / "gpu_check_phases.py"), phase, args.model]
            cmd.append(",".join(c.name for c in mine))
            results += run_phase(cmd, mine, LOGS / f"{phase}.log", lambda r: print(r.line(), flush=True))
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    print(f"gpu_check: {summary} in {time.monotonic() - began:.0f} s (logs: {LOGS})", flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
