"""Checks on a safetensors upload before any replica sees it. No torch, no unpickling: header JSON only."""

from __future__ import annotations

import json


class WeightsError(ValueError):
    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def read_header(data: bytes) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) from a safetensors blob; raises WeightsError if it is cut or malformed."""
    if len(data) < 8:
        raise WeightsError(["body is not a safetensors file (shorter than its 8-byte header length)"])
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise WeightsError([f"safetensors header says {n} bytes but only {len(data) - 8} arrived: the upload was cut"])
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise WeightsError([f"safetensors header is not JSON ({e})"]) from None
    payload = len(data) - 8 - n
    spec = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = info.get("data_offsets", [0, 0])[1]
        if end > payload:
            raise WeightsError([f"tensor {name!r} ends at byte {end} of a {payload}-byte payload: the upload was cut"])
        spec[name] = (list(info["shape"]), info["dtype"])
    return spec


def check_state_dict(expected: dict[str, tuple[list[int], str]], got: dict[str, tuple[list[int], str]]) -> list[str]:
    """Every mismatch between two specs (name -> (shape, dtype)) as a sentence; [] when they match."""
    problems = [f"missing tensor {n!r}" for n in expected if n not in got]
    problems += [f"unexpected tensor {n!r}" for n in got if n not in expected]
    for n in expected.keys() & got.keys():
        if list(expected[n][0]) != list(got[n][0]):
            problems.append(f"tensor {n!r} has shape {list(got[n][0])}, the model needs {list(expected[n][0])}")
        if expected[n][1] != got[n][1]:
            problems.append(f"tensor {n!r} has dtype {got[n][1]}, the model needs {expected[n][1]}")
    return sorted(problems)[:20]


def check_upload(data: bytes, expected: dict[str, tuple[list[int], str]]) -> int:
    """Number of tensors in `data` if it matches the model's spec exactly; else WeightsError."""
    got = read_header(data)
    problems = check_state_dict(expected, got)
    if problems:
        raise WeightsError(problems)
    return len(got)
