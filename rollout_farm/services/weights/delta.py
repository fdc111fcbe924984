"""Byte-level deltas of one tensor: the new bytes XOR the base bytes, split into byte planes, each plane compressed.

After a small optimizer step a float keeps its sign, exponent and top mantissa bits, so in the XOR the planes of the
high bytes are mostly zero and compress to almost nothing, while the low bytes stay noise (sent raw when zlib cannot
shrink them). Layout of an encoded tensor:

  1 byte   itemsize k (the planes)
  k times  1 byte kind (0 raw, 1 zlib) | 4 bytes length (little-endian) | that many bytes

decode() rebuilds the new tensor from the base one; it never inflates a plane past its known size (a hostile payload
cannot exhaust memory), and any inconsistency is a DeltaError.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from rollout_farm.services.weights.manifest import tensor_bytes

RAW, ZLIB = 0, 1
SAMPLE = 1 << 16  # bytes of a plane compressed first, to tell noise (sent raw) from structure
KEEP = 0.9  # compress a plane only when its sample shrinks below this share


class DeltaError(ValueError):
    pass


def _planes(xor: np.ndarray, k: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(xor.reshape(-1, k)[:, i]) for i in range(k)] if k > 1 else [xor]


def encode(new: torch.Tensor, base: torch.Tensor, level: int = 1) -> bytes:
    """The delta that turns `base` into `new` (same shape and dtype)."""
    if new.dtype != base.dtype or new.shape != base.shape:
        raise DeltaError(f"cannot encode {new.dtype} {list(new.shape)} against {base.dtype} {list(base.shape)}")
    k = new.element_size()
    a = np.frombuffer(tensor_bytes(new), np.uint8)
    b = np.frombuffer(tensor_bytes(base), np.uint8)
    xor = np.bitwise_xor(a, b)
    out = [bytes([k])]
    for plane in _planes(xor, k):
        data = plane.tobytes()
        kind = RAW
        if not plane.any():
            data, kind = zlib.compress(data, level), ZLIB
        elif len(zlib.compress(data[:SAMPLE], level)) < KEEP * min(len(data), SAMPLE):
            data, kind = zlib.compress(data, level), ZLIB
        out += [bytes([kind]), len(data).to_bytes(4, "little"), data]
    return b"".join(out)


def decode(payload, base: torch.Tensor) -> torch.Tensor:
    """The new tensor: `base` (CPU or not; read only) XOR the decoded planes. A fresh CPU tensor."""
    mv = memoryview(payload).cast("B")
    if len(mv) < 1 or mv[0] != base.element_size():
        raise DeltaError(f"delta is for {mv[0] if len(mv) else '?'}-byte items, the tensor has {base.element_size()}")
    k, n = base.element_size(), base.numel()
    xor = np.empty((n, k), np.uint8)
    at = 1
    for i in range(k):
        if at + 5 > len(mv):
            raise DeltaError("delta is cut short")
        kind, length = mv[at], int.from_bytes(mv[at + 1 : at + 5], "little")
        data = mv[at + 5 : at + 5 + length]
        at += 5 + length
        if len(data) != length:
            raise DeltaError("delta is cut short")
        if kind == RAW:
            plane = np.frombuffer(data, np.uint8)
        elif kind == ZLIB:
            d = zlib.decompressobj()
            try:
                raw = d.decompress(data, n)
            except zlib.error as e:
                raise DeltaError(f"a plane does not inflate: {e}") from None
            if d.unconsumed_tail or not d.eof:
                raise DeltaError(f"a plane inflates past its {n} bytes, or is cut")
            plane = np.frombuffer(raw, np.uint8)
        else:
            raise DeltaError(f"unknown plane kind {kind}")
        if plane.size != n:
            raise DeltaError(f"a plane holds {plane.size} bytes, the tensor needs {n}")
        xor[:, i] = plane
    if at != len(mv):
        raise DeltaError(f"{len(mv) - at} bytes after the last plane")
    np.bitwise_xor(xor.reshape(-1), np.frombuffer(tensor_bytes(base), np.uint8), out=xor.reshape(-1))
    return torch.from_numpy(xor.reshape(-1)).view(base.dtype).reshape(base.shape)
