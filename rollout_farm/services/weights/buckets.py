"""Buckets: the body of a weight push is one or more safetensors files back to back, each a bucket of whole tensors.

A safetensors file says its own length (8-byte header length, JSON header, then exactly the bytes its data_offsets
cover), so buckets need no other framing, and a plain safetensors upload is a push of one bucket.

Client side, `buckets` lays a state dict out as buckets of at most `bucket_bytes`: each a header, then memoryviews of
the tensors themselves (nothing is serialized into a copy). Replica side, `views` reads a bucket held in the Ray object
store as tensors that are views of it (torch.frombuffer): no copy until the engine copies each tensor into its
parameter at the commit.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from rollout_farm.services.weights.checks import DTYPE_BYTES, WeightsError, parse_header
from rollout_farm.services.weights.manifest import META_KEY, Manifest, tensor_bytes
from rollout_farm.services.weights.probe import META_KEY as PROBE_KEY
from rollout_farm.services.weights.state_dict import ST_DTYPES

TORCH_DTYPES = {v: k for k, v in ST_DTYPES.items()} | {"U8": torch.uint8, "I16": torch.int16, "I8": torch.int8}
BUCKET_BYTES = 64 << 20  # the client's default bucket size: the replicas stage one while the next streams


def header(
    entries: list[tuple[str, str, list[int], int]], manifest: Manifest | None = None, probe: str | None = None
) -> bytes:
    """A safetensors header (its 8-byte length, then JSON padded to 8 bytes) for (name, dtype, shape, nbytes) laid
    out in that order; the manifest and the probe (JSON, rollout_farm/services/weights/probe.py) in its metadata."""
    head, offset = {}, 0
    metadata = {META_KEY: manifest.to_json()} if manifest is not None else {}
    if probe is not None:
        metadata[PROBE_KEY] = probe
    if metadata:
        head["__metadata__"] = metadata
    for name, dtype, shape, nbytes in entries:
        head[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def plan(sizes: dict[str, int], bucket_bytes: int) -> list[list[str]]:
    """Tensor names grouped in order into buckets of at most bucket_bytes (a larger tensor gets a bucket alone)."""
    out: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if out[-1] and used + size > bucket_bytes:
            out.append([])
            used = 0
        out[-1].append(name)
        used += size
    return out


def buckets(
    payloads: dict[str, tuple[str, list[int], memoryview]],
    manifest: Manifest | None,
    bucket_bytes: int,
    probe: str | None = None,
) -> Iterator[memoryview]:
    """The body: for each bucket its header, then each payload's bytes (name -> (dtype, shape, bytes)). The manifest
    and the probe go in the first bucket; a push that sends no tensor at all is one bucket with the manifest alone."""
    groups = plan({n: len(p[2]) for n, p in payloads.items()}, bucket_bytes)
    for i, names in enumerate(groups):
        names = sorted(names, key=lambda n: -DTYPE_BYTES[payloads[n][0]])  # widest first: every tensor stays aligned
        entries = [(n, payloads[n][0], payloads[n][1], len(payloads[n][2])) for n in names]
        yield memoryview(header(entries, *((manifest, probe) if i == 0 else (None, None))))
        for n in names:
            yield payloads[n][2]


def full_payloads(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], memoryview]]:
    """Every tensor as itself: (safetensors dtype, shape, its bytes)."""
    return {n: (ST_DTYPES[t.dtype], list(t.shape), tensor_bytes(t)) for n, t in tensors.items()}


def size(
    payloads: dict[str, tuple[str, list[int], memoryview]],
    manifest: Manifest | None,
    bucket_bytes: int,
    probe: str | None = None,
) -> int:
    return sum(len(piece) for piece in buckets(payloads, manifest, bucket_bytes, probe))


def views(buf) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of one bucket (a numpy uint8 array or bytes, e.g. from ray.get) as views of its memory, and its
    __metadata__. WeightsError for a bucket that is cut or malformed."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else memoryview(buf.reshape(-1))
    if len(mv) < 8:
        raise WeightsError(["bucket is shorter than its 8-byte header length"])
    n = int.from_bytes(mv[:8], "little")
    if n > len(mv) - 8:
        raise WeightsError([f"bucket header says {n} bytes but only {len(mv) - 8} are there: the upload was cut"])
    spec, offsets, metadata = parse_header(bytes(mv[8 : 8 + n]), len(mv) - 8 - n)
    start, out = 8 + n, {}
    with warnings.catch_warnings():  # the object store's buffers are read-only; the views are only read
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        for name, (shape, dtype) in spec.items():
            begin, end = offsets[name]
            if dtype not in TORCH_DTYPES:
                raise WeightsError([f"tensor {name!r} has dtype {dtype}, which the engines do not load"])
            count = (end - begin) // DTYPE_BYTES[dtype]
            t = torch.frombuffer(mv, dtype=TORCH_DTYPES[dtype], count=count, offset=start + begin) if count else None
            out[name] = (t if t is not None else torch.empty(0, dtype=TORCH_DTYPES[dtype])).reshape(shape)
    return out, metadata
