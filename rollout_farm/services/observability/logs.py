"""Structured logs: one JSON object per line, `{"event": ..., "level": ..., "logger": ..., **fields}`.

Call sites name the event and pass its fields as `extra`:

    log.info("weights_pushed", extra={"version": 3, "seconds": 0.42})
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from pythonjsonlogger.json import JsonFormatter

QUIET = ("httpx", "httpcore", "urllib3", "ray", "transformers", "filelock")


def json_formatter() -> logging.Formatter:
    return JsonFormatter(
        "{message}{levelname}{name}",
        style="{",
        rename_fields={"message": "event", "levelname": "level", "name": "logger"},
    )


def json_handler(stream=sys.stdout) -> logging.Handler:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(json_formatter())
    return handler


def setup(
    level: int = logging.INFO, stream=sys.stdout, file: str | Path | None = None, console_level: int = logging.NOTSET
) -> None:
    """JSON lines on `stream` for every logger; chatty libraries only from WARNING up. With `file`, every line is
    also appended to that file, and `stream` gets only the lines from console_level up."""
    console = json_handler(stream)
    console.setLevel(console_level)
    handlers = [console]
    if file is not None:
        to_file = logging.FileHandler(file, encoding="utf-8")
        to_file.setFormatter(json_formatter())
        handlers.append(to_file)
    logging.basicConfig(level=level, handlers=handlers, force=True)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)


def setup_farm_loggers(level: int | str = logging.INFO, stream=sys.stderr) -> None:
    """In a Ray worker (an engine or ingress replica): JSON lines for the `farm.*` loggers only, leaving the
    root logger to Ray. The worker's stderr goes to its log file (and the driver's console)."""
    farm = logging.getLogger("farm")
    if not any(h.name == "farm-json" for h in farm.handlers):
        handler = json_handler(stream)
        handler.name = "farm-json"
        farm.addHandler(handler)
    farm.setLevel(level)
    farm.propagate = False
