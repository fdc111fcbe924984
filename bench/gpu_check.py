"""The GPU path, checked on a machine with one GPU (or more) and the GPU extras: run by bench/gpu_check.sh.

Each check prints one line, `PASS|FAIL|SKIP <check> <figure or reason>`. The checks run in two phases, each a child
process (bench/gpu_check_phases.py) that starts the farm on SGLang under Ray Serve, runs its checks and stops it:

    half   serve_half, rollout_half                  two engine replicas at 0.5 GPU each
    full   serve_full, rollout, session_turn,        one engine replica on the whole GPU
           trainer_step, push_path, push_nccl

The child announces each check (`BEGIN <check>`) and its result (`RESULT <json>`) on a pipe of their own, the file
descriptor in $GPU_CHECK_FD, so that nothing Ray or SGLang print can split a line; its stdout and stderr go to the
phase's log under bench/results/gpu_check/. This process holds each check to its own timeout, counted from the end
of the check before it (the first's from the start): a check that overruns is a FAIL, and the phase's remaining
checks are SKIPs. However a phase ends, its process group is stopped after (SIGTERM, then SIGKILL): Ray's and
SGLang's processes go with it. The worst case, every timeout, each phase's stop and its kill, fits in TOTAL_S, under
gpu_check.sh's backstop (`timeout`), and that with its own kill in 10 minutes. The backstop's SIGTERM (or a Ctrl-C)
stops the running phase the same way, within TERM_S + KILL_S, before the backstop's SIGKILL, and still prints the
summary line.

Without a GPU, or without the GPU extra's packages, it prints one SKIP line naming the reason and exits 0. It exits
1 when a check failed. Not part of `make test`; tests/unit/test_gpu_check.py checks the selection, the lines, the
timeouts (on stand-in children) and the skip.
"""

from __future__ import annotations

import argparse
import atexit
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
PHASE_SCRIPT = ROOT / "bench" / "gpu_check_phases.py"  # a phase's child: `PHASE_SCRIPT <phase> <model> <checks>`
PROTOCOL_FD = "GPU_CHECK_FD"  # the environment variable naming the child's end of the protocol pipe
STOP_S = 20  # after a phase's last result: its service stopping (serve.shutdown, ray.shutdown)
TERM_S = 5  # after SIGTERM to a phase's process group, before its SIGKILL
KILL_S = 3  # after SIGKILL, for the group to be gone
START_S = 20  # before the first phase: python, torch's import and the preflight
TOTAL_S = 550  # worst_case_s at most: START_S + TOTAL_S leaves a margin under gpu_check.sh's backstop
GPU_EXTRA = ("torch", "ray", "sglang")  # what the checks need: pip install -e '.[sglang]' (trainer_step: '.[trainer]')


@dataclass(frozen=True)
class Check:
    name: str
    phase: str
    timeout_s: float
    what: str


CHECKS = [
    Check("serve_half", "half", 150, "the farm on SGLang, 2 engine replicas at 0.5 GPU each: both answer"),
    Check("rollout_half", "half", 30, "a rollout on the shared GPU: 8 prompts x 4 samples, logprobs finite"),
    Check("serve_full", "full", 105, "the farm on SGLang, 1 engine replica on the whole GPU"),
    Check("rollout", "full", 30, "a rollout; how many tokens two identical greedy rollouts share"),
    Check("session_turn", "full", 30, "two turns of a token session: the second's prompt holds the first turn"),
    Check("trainer_step", "full", 65, "one batch, the trainer's step on CUDA and on the CPU: losses and grad norm"),
    Check("push_path", "full", 40, "push by path (/v1/weights/path): served, greedy tokens change"),
    Check("push_nccl", "full", 40, "push by torch.distributed (/v1/weights/distributed): served, tokens change"),
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
    """The longest the checks can take: every timeout, and each phase's stop and then its kill (SIGTERM, SIGKILL)."""
    return sum(c.timeout_s for c in checks) + (STOP_S + TERM_S + KILL_S) * len({c.phase for c in checks})


class Interrupted(BaseException):
    """SIGTERM or SIGINT (the backstop's timeout, a Ctrl-C): the running phase is stopped, the summary printed. A
    BaseException, as KeyboardInterrupt is, so that nothing catching Exception holds it."""


_running: set[subprocess.Popen] = set()  # the phase child whose group is not stopped yet: for a signal and atexit


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
        _running.add(child)
        os.close(write)  # the child's alone: the pipe ends when it exits
        try:
            lines: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=_pump, args=(os.fdopen(read), lines), daemon=True).start()
            results, running, why = _follow(child, lines, checks, show)
        finally:  # however the phase ended: an overrun, its end, a signal
            _stop(child)
            _running.discard(child)
    why = why if why is not None else f"the phase ended without its result (exit code {child.returncode})"
    return results + _unreported(checks, results, running, f"{why}; see {log}", show)


def _follow(
    child: subprocess.Popen, lines: queue.Queue, checks: list[Check], show: Callable[[Result], None]
) -> tuple[list[Result], str | None, str | None]:
    """Read the child's protocol lines until it ends, or overruns: each check's timeout from the result before it
    (the first check's from the start; its BEGIN names it), STOP_S after the last result for the stop. Returns the
    results, the check running at the end (None between checks) and why the phase ended (None: the child ended;
    the caller stops the child's group, then knows its exit code)."""
    results: list[Result] = []
    running, deadline = checks[0].name, time.monotonic() + checks[0].timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            if len(results) < len(checks):
                late = checks[len(results)]
                return results, running or late.name, f"over its {late.timeout_s:g} s timeout"
            results.append(Result("FAIL", "stop", f"the service did not stop within {STOP_S} s: killed"))
            show(results[-1])
            return results, None, ""
        if line is None:  # the child ended
            return results, running, None
        kind, _, rest = line.partition(" ")
        if kind == "BEGIN":
            running = rest
        elif kind == "RESULT":
            results.append(Result(**json.loads(rest)))
            show(results[-1])
            running = None
            deadline = time.monotonic() + (checks[len(results)].timeout_s if len(results) < len(checks) else STOP_S)


def _pump(stream, lines: queue.Queue) -> None:
    """The protocol pipe's lines to `lines`, then None when it ends."""
    with stream:
        for line in stream:
            lines.put(line.rstrip("\n"))
    lines.put(None)


def _stop(child: subprocess.Popen) -> None:
    """SIGTERM to the child's process group (the child started Ray's and SGLang's processes in it), SIGKILL after
    TERM_S; at most TERM_S + KILL_S. Waits for the whole group, not the child alone: what it started may outlive it."""
    for sig, wait_s in ((signal.SIGTERM, TERM_S), (signal.SIGKILL, KILL_S)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            child.poll()  # reaps the child: a zombie still holds its group
            try:
                os.killpg(child.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def _stop_running() -> None:
    """Stop every phase child not stopped yet (a signal cut run_phase's own stop short, or it never came to it)."""
    while _running:
        child = _running.pop()
        _stop(child)


def _interrupt(signum: int, frame) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # one stop: a second signal must not cut it short
    raise Interrupted(signal.Signals(signum).name)


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
    began, results, stopped = time.monotonic(), [], ""

    def show(result: Result) -> None:
        results.append(result)
        print(result.line(), flush=True)

    atexit.register(_stop_running)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt)
    try:
        for phase in PHASES:
            mine = [c for c in checks if c.phase == phase]
            if mine:
                cmd = [sys.executable, str(PHASE_SCRIPT), phase, args.model, ",".join(c.name for c in mine)]
                run_phase(cmd, mine, LOGS / f"{phase}.log", show)
    except Interrupted as e:
        _stop_running()
        done = {r.name for r in results}
        stopped = f", stopped by {e}: {sum(c.name not in done for c in checks)} not run"
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    print(f"gpu_check: {summary}{stopped} in {time.monotonic() - began:.0f} s (logs: {LOGS})", flush=True)
    return 1 if counts["FAIL"] or stopped else 0


if __name__ == "__main__":
    sys.exit(main())
