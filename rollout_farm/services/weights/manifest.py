"""A push's manifest: per tensor, the checksum of its full new bytes and how the push carries it.

The client puts it, as JSON, under the key "farm" of the first bucket's safetensors `__metadata__`:

  {"hash": "xxh3_128", "base": 7, "tensors": {"<name>": ["<hex digest>", "full" | "same" | "xor"], ...}}

  full  the bucket holds the new tensor as it is (model shape and dtype)
  same  unchanged since `base`: no bytes sent; the replica checks its current tensor has this checksum
  xor   the bucket holds rollout_farm/services/weights/delta.py's encoding of new XOR base (a 1-D U8 tensor)
  base  the version a `same` or `xor` tensor applies to; null (or absent) for a full push, where every tensor is full

Every replica hashes the tensors it is about to stage and refuses a mismatch, so every replica ends bit-exact with the
client's weights. No manifest: a plain safetensors upload, every tensor full, nothing to compare (as before).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from rollout_farm.services.weights.checks import WeightsError

META_KEY = "farm"
ENCODINGS = ("full", "same", "xor")


def _xxh3(data) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def _blake2b(data) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


HASHES = {"xxh3_128": _xxh3, "blake2b_128": _blake2b, "sha256": _sha256}


def default_hash() -> str:
    """xxh3_128 (about 9 GB/s on one core) where the xxhash package is installed, else blake2b_128."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "blake2b_128"
    return "xxh3_128"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as safetensors stores them (little-endian, row-major), without a copy when it is
    contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def digest(algorithm: str, data) -> str:
    try:
        return HASHES[algorithm](data)
    except KeyError:
        raise WeightsError([f"manifest hash {algorithm!r} is not one of {sorted(HASHES)}"]) from None
    except ImportError:
        raise WeightsError([f"manifest hash {algorithm!r} needs the xxhash package on the service: use blake2b_128"])


@dataclass
class Manifest:
    hash: str = "xxh3_128"
    base: int | None = None
    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (hex digest, encoding)

    def to_json(self) -> str:
        body = {"hash": self.hash, "base": self.base, "tensors": {n: list(v) for n, v in self.tensors.items()}}
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_metadata(cls, metadata: dict | None) -> Manifest | None:
        """The manifest in a bucket's `__metadata__`, None when there is none; WeightsError when it is malformed."""
        raw = (metadata or {}).get(META_KEY)
        if raw is None:
            return None
        try:
            body = json.loads(raw)
            base = body.get("base")
            tensors = {str(n): (str(h), str(e)) for n, (h, e) in body["tensors"].items()}
            m = cls(hash=str(body.get("hash", "xxh3_128")), base=None if base is None else int(base), tensors=tensors)
        except (ValueError, TypeError, KeyError, AttributeError):
            raise WeightsError(
                [f"__metadata__[{META_KEY!r}] is not a manifest: need {{hash, base, tensors: {{name: [hex, enc]}}}}"]
            ) from None
        if m.hash not in HASHES:
            raise WeightsError([f"manifest hash {m.hash!r} is not one of {sorted(HASHES)}"])
        if bad := sorted(n for n, (_, e) in m.tensors.items() if e not in ENCODINGS)[:5]:
            raise WeightsError([f"tensors {bad} have an encoding other than {', '.join(ENCODINGS)}"])
        if m.base is None and (partial := sorted(n for n, (_, e) in m.tensors.items() if e != "full")[:5]):
            raise WeightsError([f"tensors {partial} are not sent in full, but the push names no base version"])
        return m

    def sent(self) -> set[str]:
        """The tensors whose bytes travel in the buckets (full or xor)."""
        return {n for n, (_, e) in self.tensors.items() if e != "same"}


def manifest_of(
    tensors: dict[str, torch.Tensor], algorithm: str | None = None, base: int | None = None, encodings=None
) -> Manifest:
    """A manifest for `tensors` (the full new state), every tensor "full" unless `encodings` says otherwise."""
    algorithm = algorithm or default_hash()
    enc = encodings or {}
    return Manifest(
        algorithm, base, {n: (digest(algorithm, tensor_bytes(t)), enc.get(n, "full")) for n, t in tensors.items()}
    )
