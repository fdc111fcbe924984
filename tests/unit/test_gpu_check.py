"""bench/gpu_check.sh without a GPU: the skip, the check selection, the lines, the per-check timeouts and the stop on
SIGTERM, held on stand-in children (small Python scripts speaking the phase protocol: the real phase needs a GPU)
and on the real phase child up to its serve check's failure."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import gpu_check as G

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "bench/gpu_check.sh"
LINE = re.compile(r"^(PASS|FAIL|SKIP) \S+ +\S.*$")


def test_the_script_without_a_gpu_prints_one_skip_line_with_the_reason_and_exits_0():
    """CUDA_VISIBLE_DEVICES='' hides any GPU, so this holds on a GPU machine too."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and LINE.match(lines[0]), done.stdout
    assert re.match(r"^SKIP gpu_check +no GPU: torch (is a CPU build|sees no CUDA device)", lines[0]), lines[0]


def test_an_unknown_check_is_refused_with_the_valid_names():
    done = subprocess.run(["bash", SCRIPT, "--only", "rollout,nope"], cwd=ROOT, capture_output=True)
    assert done.returncode == 2
    assert b"unknown check nope: choose from serve_half, rollout_half" in done.stderr


@pytest.mark.parametrize(
    "cuda, gpus, missing, reason",
    [
        (None, 0, {"torch"}, "no torch: the GPU extra is missing"),
        (None, 0, set(), "no GPU: torch is a CPU build"),
        ("13.0", 0, set(), "no GPU: torch sees no CUDA device"),
        ("13.0", 1, {"sglang"}, "the GPU extra is missing: no sglang (pip install -e '.[sglang]')"),
        ("13.0", 1, {"ray", "sglang"}, "the GPU extra is missing: no ray, sglang"),
        ("13.0", 1, set(), None),  # the negative control: everything there, no skip
    ],
)
def test_why_skip_names_the_first_thing_missing(cuda, gpus, missing, reason):
    got = G.why_skip(cuda, gpus, lambda module: module not in missing)
    assert got == reason if reason is None else got.startswith(reason), got


def test_selection_keeps_run_order_and_brings_each_phase_its_serve_check():
    names = lambda checks: [c.name for c in checks]  # noqa: E731
    assert names(G.select(None)) == names(G.CHECKS)
    assert names(G.select(["push_nccl"])) == ["serve_full", "push_nccl"]
    assert names(G.select(["trainer_step", "rollout_half"])) == [
        "serve_half",
        "rollout_half",
        "serve_full",
        "trainer_step",
    ]
    with pytest.raises(ValueError, match="unknown check nope, serve: choose from serve_half"):
        G.select(["rollout", "nope", "serve"])


def test_the_worst_case_with_its_kills_fits_under_the_backstop_and_in_10_minutes():
    """Every timeout, each phase's stop, SIGTERM and SIGKILL: under gpu_check.sh's `timeout` with a margin; its own
    SIGTERM leaves the driver time to stop the phase before its SIGKILL; and all that within 10 minutes."""
    kill_after, backstop = map(
        int, re.search(r"timeout --kill-after=(\d+) (\d+) ", (ROOT / SCRIPT).read_text()).groups()
    )
    assert G.worst_case_s(G.CHECKS) == sum(c.timeout_s for c in G.CHECKS) + 2 * (G.STOP_S + G.TERM_S + G.KILL_S)
    assert G.worst_case_s(G.CHECKS) <= G.TOTAL_S and G.START_S + G.TOTAL_S <= backstop - 15
    assert G.TERM_S + G.KILL_S <= kill_after - 2 and backstop + kill_after <= 600
    assert {c.phase for c in G.CHECKS} == set(G.PHASES)
    assert [c.name for c in G.CHECKS if c.name.startswith("serve_")] == ["serve_half", "serve_full"]
    assert [c.phase for c in G.CHECKS] == sorted((c.phase for c in G.CHECKS), key=G.PHASES.index)  # serve first


def test_a_result_is_one_line_status_name_detail():
    line = G.Result("PASS", "push_path", "version 1: 5 tensors in 0.41 s").line()
    assert LINE.match(line) and line.split(maxsplit=2) == ["PASS", "push_path", "version 1: 5 tensors in 0.41 s"]


# run_phase on stand-in children -----------------------------------------------------------------------------------
def stand_in(body: str) -> list[str]:
    """A child running `body` with say(kind, text) and result(status, name, detail) of the phase protocol."""
    head = f"""
        import json, os, signal, sys, time
        pipe = os.fdopen(int(os.environ[{G.PROTOCOL_FD!r}]), "w", buffering=1)
        def say(kind, text): pipe.write(kind + " " + text + "\\n")
        def result(status, name, detail): say("RESULT", json.dumps(dict(status=status, name=name, detail=detail)))
    """
    return [sys.executable, "-c", textwrap.dedent(head) + textwrap.dedent(body)]


def checks(*timeouts: float) -> list[G.Check]:
    return [G.Check(f"c{i}", "full", t, "") for i, t in enumerate(timeouts)]


@pytest.fixture
def quick_stop(monkeypatch):
    for name, seconds in (("STOP_S", 1), ("TERM_S", 0.5), ("KILL_S", 1)):
        monkeypatch.setattr(G, name, seconds)


def gone(pid: int) -> bool:
    """Whether process group `pid` has no process left."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def dead(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie. A process whose parent ended first is reparented to the
    machine's init (or a subreaper), which may reap it late or never (CI's container): it stays a zombie, dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "Z"  # the state follows the command name, which may hold spaces


def test_each_result_is_shown_as_it_comes_and_other_output_goes_to_the_log(tmp_path):
    shown = []
    child = stand_in("""
        say("BEGIN", "c0"); print("Ray's chatter"); result("PASS", "c0", "fine")
        say("BEGIN", "c1"); print("warning", file=sys.stderr); result("SKIP", "c1", "needs verl")
    """)
    results = G.run_phase(child, checks(30, 30), tmp_path / "phase.log", shown.append)
    assert results == shown == [G.Result("PASS", "c0", "fine"), G.Result("SKIP", "c1", "needs verl")]
    assert sorted((tmp_path / "phase.log").read_text().splitlines()) == ["Ray's chatter", "warning"]  # any order


def test_a_check_over_its_timeout_fails_the_rest_skip_and_the_phase_is_stopped(tmp_path, quick_stop):
    """The child ignores SIGTERM, so it takes the SIGKILL (after TERM_S); its process group is gone after."""
    pid_file = tmp_path / "pid"
    child = stand_in(f"""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        say("BEGIN", "c0"); result("PASS", "c0", "fine")
        say("BEGIN", "c1"); time.sleep(600)
    """)
    results = G.run_phase(child, checks(30, 0.5, 30), tmp_path / "phase.log", lambda r: None)
    assert [(r.status, r.name) for r in results] == [("PASS", "c0"), ("FAIL", "c1"), ("SKIP", "c2")]
    assert results[1].detail.startswith("over its 0.5 s timeout; see ")
    assert results[2].detail.startswith("not run: over its 0.5 s timeout")
    assert gone(int(pid_file.read_text()))


def test_what_a_phase_started_is_stopped_with_it_when_it_ends(tmp_path, quick_stop):
    """A child that reports everything and exits, leaving a process of its own behind (Ray's daemons would): its
    group, that process with it, is gone after the phase."""
    pid_file = tmp_path / "pid"
    child = stand_in(f"""
        import subprocess
        left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(left.pid))
        say("BEGIN", "c0"); result("PASS", "c0", "fine")
    """)
    assert G.run_phase(child, checks(30), tmp_path / "phase.log", lambda r: None) == [G.Result("PASS", "c0", "fine")]
    assert dead(int(pid_file.read_text()))


def test_sigterm_stops_the_running_phase_and_still_prints_the_summary(tmp_path):
    """The backstop's SIGTERM to the driver mid-phase: the phase child (its own session, so the backstop's signal
    never reaches it) ignores SIGTERM and takes the SIGKILL; its group is gone, and the summary line counts what ran.
    The driver is main() itself, with a stand-in for the phase script and the preflight passed (no GPU here)."""
    pid_file = tmp_path / "pid"
    phase = tmp_path / "phase.py"
    phase.write_text(
        stand_in(f"""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        say("BEGIN", "serve_full"); result("PASS", "serve_full", "started")
        say("BEGIN", "rollout"); time.sleep(600)
    """)[-1]
    )
    driver = f"""
        import sys
        from pathlib import Path
        from bench import gpu_check as G
        G.preflight, G.PHASE_SCRIPT, G.LOGS, G.TERM_S = lambda: None, Path({str(phase)!r}), Path({str(tmp_path)!r}), 1
        sys.exit(G.main(["--only", "rollout,push_path"]))
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen([sys.executable, "-c", textwrap.dedent(driver)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert LINE.match(first := run.stdout.readline()) and first.split()[:2] == ["PASS", "serve_full"], first
        run.send_signal(signal.SIGTERM)
        rest = run.stdout.read().splitlines()
        assert run.wait(30) == 1
    finally:
        run.kill()
    assert gone(int(pid_file.read_text()))
    assert len(rest) == 1 and re.match(
        r"^gpu_check: 1 PASS, 0 FAIL, 0 SKIP, stopped by SIGTERM: 2 not run in ", rest[0]
    )


def test_the_first_check_is_timed_from_the_start(tmp_path, quick_stop):
    """A child that hangs before it says anything (an import, say) fails the first check."""
    results = G.run_phase(stand_in("time.sleep(600)"), checks(0.5, 30), tmp_path / "phase.log", lambda r: None)
    assert [(r.status, r.name) for r in results] == [("FAIL", "c0"), ("SKIP", "c1")]


def test_a_child_that_dies_fails_the_check_it_was_running(tmp_path):
    child = stand_in("""
        say("BEGIN", "c0"); result("PASS", "c0", "fine")
        say("BEGIN", "c1"); os._exit(3)
    """)
    results = G.run_phase(child, checks(30, 30, 30), tmp_path / "phase.log", lambda r: None)
    assert [(r.status, r.name) for r in results] == [("PASS", "c0"), ("FAIL", "c1"), ("SKIP", "c2")]
    assert results[1].detail.startswith("the phase ended without its result (exit code 3); see ")


def test_a_child_that_dies_between_checks_fails_the_next_one(tmp_path):
    child = stand_in("""say("BEGIN", "c0"); result("PASS", "c0", "fine"); sys.exit(1)""")
    results = G.run_phase(child, checks(30, 30), tmp_path / "phase.log", lambda r: None)
    assert [(r.status, r.name) for r in results] == [("PASS", "c0"), ("FAIL", "c1")]


def test_a_stop_that_overruns_is_a_failure_of_its_own(tmp_path, quick_stop):
    child = stand_in("""say("BEGIN", "c0"); result("PASS", "c0", "fine"); time.sleep(600)""")
    results = G.run_phase(child, checks(30), tmp_path / "phase.log", lambda r: None)
    assert [(r.status, r.name) for r in results] == [("PASS", "c0"), ("FAIL", "stop")]


# the real phase child, as far as it goes without a GPU --------------------------------------------------------------
def test_the_phase_child_reports_a_failed_start_and_skips_what_needs_it(tmp_path):
    """bench/gpu_check_phases.py on a model folder that does not exist: its serve check fails before Ray starts,
    with the error's first line, and the checks after it are SKIPs naming it."""
    mine = G.select(["rollout", "push_nccl"])
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check_phases.py"), "full", str(tmp_path / "none")]
    cmd.append(",".join(c.name for c in mine))
    results = G.run_phase(cmd, mine, tmp_path / "full.log", lambda r: None)
    assert [(r.status, r.name) for r in results] == [("FAIL", "serve_full"), ("SKIP", "rollout"), ("SKIP", "push_nccl")]
    assert results[0].detail.startswith("FileNotFoundError: no model folder at ")
    assert results[1].detail == "needs serve_full, which failed"
    assert "Traceback" in (tmp_path / "full.log").read_text()


def test_sample_problems_names_errors_mismatches_and_bad_logprobs():
    from bench.gpu_check_phases import sample_problems
    from rollout_farm.services import protocol as P

    def group(*samples):
        return P.Group(prompt_token_ids=[1], samples=list(samples), reward_mean=0.0, reward_std=0.0, zero_variance=True)

    def sample(ids, logprobs, finish="length"):
        return P.Sample.model_validate(
            {"token_ids": ids, "logprobs": logprobs, "text": "", "finish_reason": finish, "weight_version": 0}
        )

    good = sample([5, 6], [-0.5, -1.25])
    assert sample_problems([group(good, good)]) == []  # the negative control
    bad = [
        sample([5, 6], [-0.5]),
        sample([], []),
        sample([5], [-0.1], "error"),
        sample([5, 6], [-0.5, float("nan")]),
        sample([5], [0.3]),
    ]
    problems = sample_problems([group(good, *bad)])
    assert len(problems) == len(bad), json.dumps(problems)


def test_a_collective_that_fails_reports_the_farms_refusal_when_there_is_one():
    """push_nccl's side of the group waits for the engine's; when the farm refused the call that should have brought
    it, that refusal is the error shown, else the collective's own."""
    from bench.gpu_check_phases import Call, farm_error_first

    def refused():
        raise AssertionError("POST /v1/weights/distributed/init: 501 the engine has no NCCL transport")

    with pytest.raises(AssertionError, match="501 the engine has no NCCL"):
        with farm_error_first(Call(refused)):
            raise RuntimeError("rendezvous timed out")
    with pytest.raises(RuntimeError, match="rendezvous timed out"):  # the negative control: the farm said yes
        with farm_error_first(Call(lambda: {"replicas": 1})):
            raise RuntimeError("rendezvous timed out")
    assert Call(lambda: 7).result() == 7


def test_gpu_memory_reads_nvidia_smi_and_is_none_when_it_cannot(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on the PATH (none runs here), answering as the real one does for this query."""
    from bench import gpu_check_phases as phases

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 2048, 81559'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert phases.gpu_memory() == ("NVIDIA H100 80GB HBM3", 2.0, pytest.approx(79.647, abs=1e-3))
    assert phases.shown_memory() == "NVIDIA H100 80GB HBM3: 2.0 of 79.6 GiB in use"
    phases.wait_for_free_gpu(limit_s=600)  # a tenth is not in use: no wait
    smi.write_text("#!/bin/sh\necho 'No devices were found'\n")
    assert phases.gpu_memory() is None and phases.shown_memory() == "GPU memory unknown (no nvidia-smi reading)"
