"""docs/settings.md, generated from the service settings: one row per FARM_* variable of ServiceSettings (its type,
default, allowed values and description), then the few FARM_* variables read outside it.

    python -m rollout_farm.services.config.settings_doc > docs/settings.md

tests/unit/test_settings_doc.py fails when docs/settings.md is not what this writes: edit the descriptions in
rollout_farm/services/config/settings.py, then regenerate.
"""

from __future__ import annotations

import re
import sys
import types
import typing

from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from rollout_farm.services.config.settings import SECRET_FIELDS, ServiceSettings

BOUNDS = {Ge: (">=", "ge"), Gt: (">", "gt"), Le: ("<=", "le"), Lt: ("<", "lt")}  # annotated_types -> (shown, attr)
COMMAND = "python -m rollout_farm.services.config.settings_doc > docs/settings.md"

# FARM_* variables read outside ServiceSettings: variable -> (who reads it, default, what it is).
READ_ELSEWHERE = {
    "FARM_VLLM_PARENT_PID": (
        "rollout_farm/services/engine/vllm_side/farm_vllm_launch.py",
        "set by the vLLM engine",
        "Internal: the replica a vLLM server belongs to; the server's process group ends once it is gone.",
    ),
    "FARM_CACHE": (
        "rollout_farm/services/models.py",
        "~/.cache/rollout-farm",
        "Cache folder: the embedded default model is built here once, and the embedded Redis keeps its state under "
        "`$FARM_CACHE/state/` unless FARM_STATE_DIR is set.",
    ),
    "FARM_URL": (
        "rollout_farm/trainer/cli.py, rollout_farm/integrations/verl/server.py",
        "http://127.0.0.1:8000 (the CLI; verl needs it or its own setting)",
        "The service the `farm rollout | weights | control | ...` commands and the verl rollout backend call.",
    ),
    "FARM_WEIGHT_SYNC_STATS": (
        "rollout_farm/trainer/sync/weights.py",
        "unset",
        "A file the trainer appends one JSON line to per weight push (seconds, bytes, mode); `bench/weight_sync.py` "
        "sets it.",
    ),
}

INTRO = """\
The service (`farm serve`, `serve run rollout_farm.services.serving.serve_entry:app`, the compose stack and the Helm
chart) reads these environment variables once, at start-up. A bad value stops it with one line per variable naming the
value and the fix (a missing token: how to make one). A list is JSON (`FARM_PLUGINS='["my_pkg.rewards"]'`), a
boolean `true` or `false`; a byte count is a plain integer."""

ELSEWHERE_NOTE = """\
The `farm` client commands, the trainer and the verl integration also read `FARM_API_TOKEN` (the token they send),
and the trainer's console reads `FARM_LOG_LEVEL`. These variables are read outside `ServiceSettings`:"""


def render(settings: type[BaseSettings] = ServiceSettings) -> str:
    """The whole of docs/settings.md for this settings class."""
    prefix = settings.model_config.get("env_prefix", "")
    rows = [_row(f"{prefix}{name.upper()}", name, field) for name, field in settings.model_fields.items()]
    others = [
        [f"`{var}`", _cell(who), _cell(default), _cell(what)] for var, (who, default, what) in READ_ELSEWHERE.items()
    ]
    return "\n".join(
        [
            "_Generated from `rollout_farm/services/config/settings.py` by "
            f"`rollout_farm/services/config/settings_doc.py`: "
            f"edit the descriptions there, then run `{COMMAND}`._",
            "",
            "# Service settings (`FARM_*`)",
            "",
            INTRO,
            "",
            *_table(["variable", "type", "default", "allowed", "description"], rows),
            "",
            "## Read elsewhere",
            "",
            ELSEWHERE_NOTE,
            "",
            *_table(["variable", "read by", "default", "description"], others),
            "",
        ]
    )


def _row(var: str, name: str, field: FieldInfo) -> list[str]:
    secret = name in SECRET_FIELDS or _bare(field.annotation) is SecretStr
    return [f"`{var}`", _type(field.annotation), _default(field, secret), _allowed(field), _cell(field.description)]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _cell(text: str | None) -> str:
    """Table-safe text: a `|` would end the cell."""
    return (text or "").replace("|", "\\|").replace("\n", " ")


def _bare(annotation) -> object:
    """The annotation without `| None` (an unset optional setting shows as its default, 'unset')."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return annotation
    (bare,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return bare


def _type(annotation) -> str:
    bare = _bare(annotation)
    if bare is SecretStr:
        return "str (secret)"
    if typing.get_origin(bare) is typing.Literal:
        return "str"
    if typing.get_origin(bare) is list:
        (item,) = typing.get_args(bare)
        return f"JSON list of {item.__name__}"
    return bare.__name__


def _default(field: FieldInfo, secret: bool) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    if secret:
        return "(secret)"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    shown = f"`{_cell(value if isinstance(value, str) else repr(value))}`"
    return f"{shown} ({_size(value)})" if isinstance(value, int) and value >= 1 << 20 else shown


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _allowed(field: FieldInfo) -> str:
    """The field's limits: its Literal values, a pattern's alternatives (or the pattern), bounds, a minimum length."""
    parts = []
    if typing.get_origin(bare := _bare(field.annotation)) is typing.Literal:
        parts.append(", ".join(f"`{v}`" for v in typing.get_args(bare)))
    for m in field.metadata:
        if pattern := getattr(m, "pattern", None):
            choice = re.fullmatch(r"\^\(([\w|]+)\)\$", pattern)
            parts.append(", ".join(f"`{v}`" for v in choice[1].split("|")) if choice else f"matches `{_cell(pattern)}`")
        elif isinstance(m, Ge | Gt | Le | Lt):
            op, bound = BOUNDS[type(m)]
            parts.append(f"{op} {getattr(m, bound)}")
        elif isinstance(m, MinLen):
            parts.append(f"{m.min_length}+ characters")
    return ", ".join(parts)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
