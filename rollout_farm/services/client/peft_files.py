"""A peft adapter folder as files: which two files it holds, and the body of an adapter upload made from them.

Stdlib only, so that the client (rollout_farm/services/client/farm_client.py) pushes a folder without the service's
packages; the checks of what the files say are rollout_farm/services/adapters/peft_format.py's.
"""

from __future__ import annotations

import json
import pathlib

CONFIG_FILE, TENSORS_FILE = "adapter_config.json", "adapter_model.safetensors"
CONFIG_META, PROBE_META = "adapter_config", "probe"  # an upload's __metadata__ keys


class AdapterInvalid(ValueError):
    """The adapter does not fit the served model; `problems` are {field, message} pairs (a 422's detail)."""

    def __init__(self, problems: list[dict]):
        super().__init__("; ".join(f"{p['field']}: {p['message']}" for p in problems))
        self.problems = problems


def problem(field: str, message: str) -> dict:
    return {"field": field, "message": message}


def folder_files(path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A peft adapter folder's config and tensors files; AdapterInvalid naming a missing one."""
    folder = pathlib.Path(path)
    missing = [f for f in (CONFIG_FILE, TENSORS_FILE) if not (folder / f).is_file()]
    if missing:
        raise AdapterInvalid(
            [
                problem(
                    "path",
                    f"{folder} has no {', '.join(missing)}: give a peft adapter folder "
                    "(model.save_pretrained writes both)",
                )
            ]
        )
    return folder / CONFIG_FILE, folder / TENSORS_FILE


def upload_body(folder: str | pathlib.Path, probe: dict | None = None) -> bytes:
    """The body of POST /v1/adapters/{name}: the folder's adapter_model.safetensors with its adapter_config.json put
    in the header's __metadata__ (one self-describing file; the tensor bytes unchanged), and the probe, if any
    (rollout_farm/services/weights/probe.py: token sequences and the logprobs the pusher computed for them)."""
    config_file, tensors_file = folder_files(folder)  # the service checks the config (a 422 naming its fields)
    raw = tensors_file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    head["__metadata__"] = {**head.get("__metadata__", {}), CONFIG_META: config_file.read_text()}
    if probe is not None:
        head["__metadata__"][PROBE_META] = json.dumps(probe)
    new = json.dumps(head, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    return len(new).to_bytes(8, "little") + new + raw[8 + n :]
