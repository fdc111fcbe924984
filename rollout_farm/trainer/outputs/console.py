"""The console of `farm train --log-file` (the demo's): every JSON log line goes to the file, the console gets the
progress bar, a short line every LINE_EVERY steps, and warnings and errors; FARM_LOG_LEVEL=debug adds every JSON line.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

from tqdm import tqdm

from rollout_farm.services.observability import logs

log = logging.getLogger("farm.trainer")

LINE_EVERY = 10  # steps between the console's short lines


class BarSafe:
    """A stream whose writes clear tqdm's progress bars first and draw them again after, so that a console line
    does not land inside the bar."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        tqdm.write(s, file=self.stream, end="")

    def flush(self) -> None:
        self.stream.flush()


def step_line(
    step: int,
    total: int,
    reward: float,
    kl: float,
    tokens_per_s: float,
    s_per_step: float,
    accuracy: float | None = None,
) -> str:
    """The console's short line, e.g. `step 10/80  reward 0.31  kl 0.012  tokens/s 480  4.9 s/step`."""
    line = (
        f"step {step}/{total}  reward {reward:.2f}  kl {kl:.3g}  tokens/s {tokens_per_s:.0f}  {s_per_step:.1f} s/step"
    )
    return line if accuracy is None else f"{line}  accuracy {accuracy:.3f}"


class StepLines(logging.Handler):
    """Writes step_line for the train_step events of every `every`-th step and of the last: that step's reward and
    KL, the last held-out accuracy if the run scores during training (trainer.test_freq), and tokens/s and s/step
    over the steps since the previous line."""

    def __init__(self, total: int, stream, every: int = LINE_EVERY):
        super().__init__(logging.INFO)
        self.total, self.stream, self.every = total, stream, every
        self.accuracy: float | None = None
        self.elapsed = 0.0  # elapsed_s at the previous line
        self._window()

    def _window(self) -> None:
        self.steps, self.tokens, self.seconds = 0, 0.0, 0.0

    def emit(self, record: logging.LogRecord) -> None:
        if record.name != log.name or record.msg != "train_step":
            return
        try:
            m = record.__dict__
            step, seconds = m.get("step", 0), m.get("step_seconds", 0.0)
            self.steps += 1
            self.seconds += seconds
            self.tokens += m.get("tokens_per_s", 0.0) * seconds
            if m.get("val_accuracy") is not None:
                self.accuracy = m["val_accuracy"]
            if step % self.every and step != self.total:
                return
            elapsed = m.get("elapsed_s", self.elapsed + self.seconds)
            rate = self.tokens / self.seconds if self.seconds else 0.0
            reward, kl = m.get("reward_mean", math.nan), m.get("kl_ref", math.nan)
            line = step_line(step, self.total, reward, kl, rate, (elapsed - self.elapsed) / self.steps, self.accuracy)
            self.stream.write(line + "\n")
            self.stream.flush()
            self.elapsed = elapsed
            self._window()
        except Exception:
            self.handleError(record)


def console_level(farm_log_level: str | None) -> int:
    """The level from which JSON log lines reach the console with a log file: WARNING (or FARM_LOG_LEVEL if higher);
    FARM_LOG_LEVEL=debug: every line."""
    level = logging.getLevelName((farm_log_level or "INFO").upper())
    level = level if isinstance(level, int) else logging.INFO
    return logging.DEBUG if level <= logging.DEBUG else max(level, logging.WARNING)


def log_to_file(path: str | Path, total_steps: int, stream=None) -> None:
    """`farm train --log-file`: every JSON log line is appended to `path`; the console (stdout) gets the warnings and
    errors as JSON and StepLines' short line every LINE_EVERY steps, and with FARM_LOG_LEVEL=debug every JSON line
    too. metrics.jsonl is written as before."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars each time the trainer loads a model
    console = BarSafe(stream if stream is not None else sys.stdout)
    logs.setup(stream=console, file=path, console_level=console_level(os.environ.get("FARM_LOG_LEVEL")))
    logging.getLogger().addHandler(StepLines(total_steps, console))
