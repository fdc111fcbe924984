"""Structured logs: one JSON object per line, `{"event": ..., "level": ..., "logger": ..., **fields}`.

Call sites name the event and pass its fields as `extra`:

    log.info("weights_pushed", extra={"version": 3, "seconds": 0.42})
"""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

QUIET = ("httpx", "httpcore", "urllib3", "ray", "transformers", "filelock")


def json_handler(stream=sys.stdout) -> logging.Handler:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        JsonFormatter(
            "{message}{levelname}{name}",
            style="{",
            rename_fields={"message": "event", "levelname": "level", "name": "logger"},
        )
    )
    return handler


def setup(level: int = logging.INFO, stream=sys.stdout) -> None:
    """JSON lines on `stream` for every logger; chatty libraries only from WARNING up."""
    logging.basicConfig(level=level, handlers=[json_handler(stream)], force=True)
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
