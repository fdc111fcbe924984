"""Every check on pushed weights. Headers: safetensors header JSON against the model's tensors, before any replica
sees a byte of them (no torch, no unpickling). Tensors: NaN and inf, on the replica that stages them (an upload's
bucket by bucket as they arrive: rollout_farm/services/weights/stage.py hands the engine a FiniteTensors, checked
already)."""

from __future__ import annotations

import json
import math

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


class WeightsRejected(ValueError):
    """A weight update that does not match the model; the engine keeps its old version."""


class WeightsError(ValueError):
    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def read_header_file(path) -> dict[str, tuple[list[int], str]]:
    """The same for a file on disk, reading only its header."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        size = f.seek(0, 2)
        if n < 0 or n > size - 8:
            raise WeightsError([f"{path} is not a safetensors file, or it is cut"])
        f.seek(8)
        return _parse(f.read(n), size - 8 - n)


def _parse(raw: bytes, payload: int) -> dict[str, tuple[list[int], str]]:
    return parse_header(raw, payload)[0]


def parse_header(raw: bytes, payload: int | None = None) -> tuple[dict, dict[str, tuple[int, int]], dict]:
    """(name -> (shape, dtype), name -> (begin, end), __metadata__) of a safetensors header. `payload`: the bytes
    after the header (None: not known yet, while streaming; then the tensors' ranges say it). The ranges must cover
    the payload without gaps or overlaps, as safetensors writes them."""
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise WeightsError([f"safetensors header is not JSON ({e})"]) from None
    if not isinstance(header, dict):
        raise WeightsError(["safetensors header is not a JSON object"])
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise WeightsError(["safetensors __metadata__ is not a JSON object"])
    spec, offsets = {}, {}
    for name, info in header.items():
        try:
            shape, dtype, (begin, end) = (
                [int(x) for x in info["shape"]],
                str(info["dtype"]),
                map(int, info["data_offsets"]),
            )
        except (KeyError, TypeError, ValueError):
            raise WeightsError(
                [f"tensor {name!r} has a malformed header entry: need shape, dtype and data_offsets"]
            ) from None
        if payload is not None and end > payload:
            raise WeightsError([f"tensor {name!r} ends at byte {end} of a {payload}-byte payload: the upload was cut"])
        if min(shape, default=0) < 0 or not 0 <= begin <= end:
            raise WeightsError([f"tensor {name!r} has a negative shape or byte range"])
        if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise WeightsError(
                [
                    f"tensor {name!r} holds {end - begin} bytes, but shape {shape} of {dtype} needs "
                    f"{math.prod(shape) * DTYPE_BYTES[dtype]}"
                ]
            )
        spec[name], offsets[name] = (shape, dtype), (begin, end)
    at = 0
    for name, (begin, end) in sorted(offsets.items(), key=lambda kv: kv[1]):
        if begin != at:
            raise WeightsError([f"tensor {name!r} starts at byte {begin}, not {at}: the byte ranges leave a gap"])
        at = end
    return spec, offsets, metadata


def payload_size(offsets: dict[str, tuple[int, int]]) -> int:
    """The bytes a header's tensors cover (its data follows the header)."""
    return max((end for _, end in offsets.values()), default=0)


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


class FiniteTensors(dict):
    """A state dict whose every floating-point tensor rollout_farm/services/weights/stage.py has checked with non_finite
    (an upload's bucket by bucket, while the next one streamed), held read-only: non_finite does not look again."""


def non_finite(tensors: dict, limit: int = 20) -> list[str]:
    """A sentence for each floating-point tensor holding NaN or +-inf (at most `limit`): such weights would make
    every sampled token fail. [] at once for a FiniteTensors, checked as it was staged."""
    if isinstance(tensors, FiniteTensors):
        return []
    out = []
    for name, t in tensors.items():
        # the sum is finite when every element is (NaN and inf propagate); only then is the exact check skipped
        if t.is_floating_point() and not bool(t.sum().isfinite()) and not bool(t.isfinite().all()):
            nan = int(t.isnan().sum())
            inf = int(t.isinf().sum())
            out.append(f"tensor {name!r} holds {nan} NaN and {inf} inf values: push finite weights")
            if len(out) == limit:
                break
    return out
