"""The demo's console (`farm train --log-file`): a step's JSON line goes to the log file and metrics.jsonl, not to the
console, unless FARM_LOG_LEVEL=debug; the console gets warnings and a short line every 10 steps."""

import io
import json
import logging

import pytest

from rollout_farm.trainer import cli
from rollout_farm.trainer.outputs import step_metrics
from rollout_farm.trainer.outputs.console import StepLines, console_level, log_to_file


@pytest.fixture
def root_logging():
    """Put the root logger back as it was: log_to_file replaces its handlers."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers:
        if h not in handlers:
            h.close()
    root.handlers[:] = handlers
    root.setLevel(level)


def metrics(step: int, began: int = 0) -> dict:
    """A step's metrics as the loop gives them (5 s a step; elapsed_s counts from the run's first step)."""
    return {
        "step": step,
        "reward_mean": 0.25 + step / 100,
        "kl_ref": 0.0123,
        "tokens_per_s": 400.0 + 10 * step,
        "step_seconds": 5.0,
        "elapsed_s": 5.0 * (step - began),
        "guard_actions": [],
    }


def run_steps(monkeypatch, tmp_path, level: str | None, steps: range, total: int = 80, **extra) -> io.StringIO:
    """log_to_file as `farm train --log-file` sets it up, then steps recorded as the loop records them (with `extra`
    at the step it names); the console."""
    if level is None:
        monkeypatch.delenv("FARM_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("FARM_LOG_LEVEL", level)
    console = io.StringIO()
    log_to_file(tmp_path / "train.log", total, stream=console)
    for step in steps:
        step_metrics.record(tmp_path, metrics(step, steps.start - 1) | extra.get(f"at_{step}", {}))
    return console


def test_at_info_the_console_gets_a_short_line_every_10_steps_and_the_files_get_the_json(
    monkeypatch, tmp_path, root_logging
):
    console = run_steps(monkeypatch, tmp_path, None, range(1, 21))
    logging.getLogger("farm.trainer").warning("empty_batch", extra={"step": 21})
    assert "train_step" not in console.getvalue()  # no step JSON on the console
    lines = console.getvalue().splitlines()
    assert lines[0] == "step 10/80  reward 0.35  kl 0.0123  tokens/s 455  5.0 s/step"
    assert lines[1] == "step 20/80  reward 0.45  kl 0.0123  tokens/s 555  5.0 s/step"
    warning = json.loads(lines[2])  # warnings and errors still reach the console
    assert warning["event"] == "empty_batch" and warning["level"] == "WARNING"
    assert len(lines) == 3
    logged = [json.loads(line) for line in (tmp_path / "train.log").read_text().splitlines()]
    recorded = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in logged if r["event"] == "train_step"] == [
        r | {"level": "INFO", "logger": "farm.trainer"} for r in recorded
    ]
    assert len(recorded) == 20 and recorded[0] == {"event": "train_step", **metrics(1)}
    assert logged[-1]["event"] == "empty_batch"


def test_at_debug_the_console_gets_every_json_line(monkeypatch, tmp_path, root_logging):
    console = run_steps(monkeypatch, tmp_path, "debug", range(1, 4))
    steps = [json.loads(line) for line in console.getvalue().splitlines() if line.startswith("{")]
    assert [s["step"] for s in steps if s["event"] == "train_step"] == [1, 2, 3]


def test_the_last_step_gets_a_line_with_the_accuracy_when_known(monkeypatch, tmp_path, root_logging):
    console = run_steps(monkeypatch, tmp_path, None, range(11, 14), total=13, at_12={"val_accuracy": 0.5123})
    # 13 is no multiple of 10 but the last step; tokens/s and s/step over steps 11 to 13
    assert console.getvalue() == "step 13/13  reward 0.38  kl 0.0123  tokens/s 520  5.0 s/step  accuracy 0.512\n"


def test_console_level():
    assert console_level(None) == logging.WARNING
    assert console_level("info") == logging.WARNING
    assert console_level("DEBUG") == logging.DEBUG
    assert console_level("error") == logging.ERROR
    assert console_level("nonsense") == logging.WARNING


def test_farm_train_log_file_sets_up_the_file_before_training(monkeypatch, tmp_path, root_logging):
    import rollout_farm.trainer.loop
    import rollout_farm.trainer.run

    seen = {}
    monkeypatch.setattr(rollout_farm.trainer.run, "TrainingRun", lambda cfg, token: cfg)
    monkeypatch.setattr(
        rollout_farm.trainer.loop, "train", lambda cfg: seen.update(handlers=logging.getLogger().handlers[:])
    )
    cli.main(["train", "--steps", "30", "--log-file", str(tmp_path / "train.log")])
    files = [h for h in seen["handlers"] if isinstance(h, logging.FileHandler)]
    assert [h.baseFilename for h in files] == [str(tmp_path / "train.log")]
    lines = [h for h in seen["handlers"] if isinstance(h, StepLines)]
    assert len(lines) == 1 and lines[0].total == 30
