"""A replica's side of an upload: the full new state dict to stage, from the buckets in the object store.

  full push   every tensor is a view of its bucket (no copy); with a manifest each one's checksum is verified
  base push   (bucketed or delta) the manifest names `base`: this replica must serve exactly that version; a "same"
              tensor is the served tensor itself (its checksum verified), an "xor" one is decoded against the served
              tensor, and every rebuilt tensor must match the client's checksum
A checksum that does not match after a delta, or a base that is not the served version, is BaseMismatch: the
replica's weights are not the ones the client diffed against, and only a full push can fix that (a 409 naming it).
A tensor sent in full that does not match its checksum is WeightsRejected: the upload was damaged (a 422).
"""

from __future__ import annotations

from typing import Protocol

import ray
import torch

from services.weights.buckets import views
from services.weights.checks import WeightsError, WeightsRejected
from services.weights.delta import DeltaError, decode
from services.weights.manifest import Manifest, digest, tensor_bytes

FULL_PUSH = "send a full push (all tensors, no base); services.weights.pusher.WeightPusher falls back to one by itself"


class Served(Protocol):
    """What staging reads of the replica's engine (services.engine.Engine): the served version and tensors."""

    weight_version: int

    def served_tensors(self) -> dict[str, torch.Tensor] | None: ...


class BaseMismatch(ValueError):
    """The delta does not apply to this replica's weights."""


def from_buckets(refs: list) -> tuple[dict[str, torch.Tensor], Manifest | None]:
    """Every bucket's tensors as views of the object store's copy, and the manifest of the first bucket."""
    tensors, manifest = {}, None
    for i, ref in enumerate(refs):
        got, metadata = views(ray.get(ref))
        if i == 0:
            manifest = Manifest.from_metadata(metadata)
        tensors.update(got)
    return tensors, manifest


def staged_tensors(source: tuple, engine: Served) -> dict[str, torch.Tensor]:
    """The full new state dict of an upload `source` ("bytes", refs) or ("delta", {"base", "refs"}), checked."""
    kind, where = source
    try:
        tensors, m = from_buckets(where if kind == "bytes" else where["refs"])
    except WeightsError as e:
        raise WeightsRejected("; ".join(e.problems)) from None
    if m is None:
        if kind == "delta":
            raise WeightsRejected("a push with a base version needs a manifest")
        return tensors
    if m.base is not None and m.base != engine.weight_version:
        raise BaseMismatch(
            f"the push applies to base version {m.base}, but this replica serves {engine.weight_version}: {FULL_PUSH}"
        )
    served = engine.served_tensors() if m.base is not None else None
    if m.base is not None and served is None:
        raise BaseMismatch(f"the {type(engine).__name__} engine cannot apply a push with a base version: {FULL_PUSH}")
    out, damaged, diverged = {}, [], []
    for name, (want, enc) in m.tensors.items():
        if enc == "full":
            out[name] = tensors[name]
        elif enc == "same":
            out[name] = served[name]
        else:
            try:
                out[name] = decode(tensor_bytes(tensors[name]), served[name]).to(served[name].device)
            except DeltaError as e:
                raise WeightsRejected(f"tensor {name!r}: the delta is malformed ({e})") from None
        try:
            got = digest(m.hash, tensor_bytes(out[name]))
        except WeightsError as e:
            raise WeightsRejected("; ".join(e.problems)) from None
        if got != want:
            (damaged if enc == "full" else diverged).append(name)
    if damaged:
        raise WeightsRejected(
            f"tensors {damaged[:5]} do not match their {m.hash} checksum in the manifest: the upload was damaged; "
            "send it again"
        )
    if diverged:
        raise BaseMismatch(
            f"tensors {diverged[:5]} rebuilt from this replica's version {engine.weight_version} do not match their "
            f"{m.hash} checksum: the replica's weights differ from the client's base; {FULL_PUSH}"
        )
    return out
