"""A replica's side of an upload: the full new state dict to stage, built bucket by bucket from the object store.

Staging runs per bucket, as each one arrives (the ingress sends it while the next one streams), and once more over
the whole push at the end:

  per bucket  every tensor is a view of its bucket (no copy); with a manifest each one's checksum is verified, an
              "xor" tensor is first decoded against the served tensor; every floating-point tensor is checked for
              NaN and inf
  whole push  the buckets that did not come early (a replica that started mid-push, a catch-up) are staged now; the
              manifest this replica reads in the first bucket must name exactly the checksums verified; a "same"
              tensor is the served tensor itself (its checksum verified); the result is a FiniteTensors, which the
              engine's stage_weights checks against the model without a second NaN pass

A push with a base (bucketed or delta) applies only to that version: a base that is not the served version, or a
checksum that does not match after a delta, is BaseMismatch: the replica's weights are not the ones the client
diffed against, and only a full push can fix that (a 409 naming it). A tensor sent in full that does not match its
checksum, or that holds NaN or inf, is WeightsRejected: the upload was damaged or the weights are bad (a 422).
"""

from __future__ import annotations

import threading
from typing import Protocol

import ray
import torch

from rollout_farm.services.weights.buckets import views
from rollout_farm.services.weights.checks import FiniteTensors, WeightsError, WeightsRejected, non_finite
from rollout_farm.services.weights.delta import DeltaError, decode
from rollout_farm.services.weights.manifest import Manifest, digest, tensor_bytes

FULL_PUSH = (
    "send a full push (all tensors, no base); rollout_farm.services.weights.pusher.WeightPusher falls back to one "
    "by itself"
)


class Served(Protocol):
    """What staging reads of the replica's engine (rollout_farm.services.engine.Engine): the served version and
    tensors."""

    weight_version: int

    def served_tensors(self) -> dict[str, torch.Tensor] | None: ...


class BaseMismatch(ValueError):
    """The delta does not apply to this replica's weights."""


def _base_served(m: Manifest, engine: Served) -> None:
    """BaseMismatch unless this replica serves the push's base version."""
    if m.base != engine.weight_version:
        raise BaseMismatch(
            f"the push applies to base version {m.base}, but this replica serves {engine.weight_version}: {FULL_PUSH}"
        )


def _served(m: Manifest, engine: Served) -> dict[str, torch.Tensor]:
    """The served tensors a push with a base applies to; BaseMismatch unless this replica serves that base."""
    _base_served(m, engine)
    served = engine.served_tensors()
    if served is None:
        raise BaseMismatch(f"the {type(engine).__name__} engine cannot apply a push with a base version: {FULL_PUSH}")
    return served


def _checked(m: Manifest, names: dict[str, str], out: dict[str, torch.Tensor]) -> None:
    """Each tensor of `out` against its checksum in `m`; `names` says how each came (full, same, xor)."""
    damaged, diverged = [], []
    for name, enc in names.items():
        try:
            got = digest(m.hash, tensor_bytes(out[name]))
        except WeightsError as e:
            raise WeightsRejected("; ".join(e.problems)) from None
        if got != m.tensors[name][0]:
            (damaged if enc == "full" else diverged).append(name)
    if damaged:
        raise WeightsRejected(
            f"tensors {damaged[:5]} do not match their {m.hash} checksum in the manifest: the upload was damaged; "
            "send it again"
        )
    if diverged:
        raise BaseMismatch(
            f"tensors {diverged[:5]} rebuilt from this replica's served version do not match their {m.hash} checksum: "
            f"the replica's weights differ from the client's base; {FULL_PUSH}"
        )


def _finite(tensors: dict[str, torch.Tensor]) -> None:
    if problems := non_finite(tensors):
        raise WeightsRejected("; ".join(problems))


class Staging:
    """One push staged on this replica: the buckets so far, each checked as it came (add), then the whole push
    (finish). `add` may run for several buckets at once, in threads."""

    def __init__(self, version: int):
        self.version = version
        self.buckets: dict[int, str] = {}  # index -> the object id of the bucket staged there
        self.tensors: dict[str, torch.Tensor] = {}
        self.verified: dict[str, tuple[str, str]] = {}  # name -> the manifest entry (digest, encoding) it matched
        self.manifest: Manifest | None = None  # as this replica reads it in the first bucket
        self.lock = threading.Lock()

    def add(self, index: int, ref, manifest: Manifest | None, engine: Served) -> None:
        """Stage bucket `index` (an ObjectRef); `manifest` holds at least the entries of its tensors (the ingress
        sends them with each bucket, as the first one may still be staging). WeightsRejected or BaseMismatch when it
        is refused."""
        try:
            tensors, metadata = views(ray.get(ref))
            own = Manifest.from_metadata(metadata) if index == 0 else None
        except WeightsError as e:
            raise WeightsRejected("; ".join(e.problems)) from None
        m = own if index == 0 else manifest  # finish() checks the ingress's entries against this replica's own
        out, verified = dict(tensors), {}
        if m is not None:
            if m.base is not None:
                _base_served(m, engine)
            if missing := sorted(tensors.keys() - m.tensors.keys())[:5]:
                raise WeightsRejected(f"tensors {missing} are not in the manifest")
            xor = [n for n in tensors if m.tensors[n][1] == "xor"]
            served = _served(m, engine) if xor else None
            for name in xor:
                try:
                    out[name] = decode(tensor_bytes(tensors[name]), served[name]).to(served[name].device)
                except DeltaError as e:
                    raise WeightsRejected(f"tensor {name!r}: the delta is malformed ({e})") from None
            _checked(m, {n: m.tensors[n][1] for n in out}, out)
            verified = {n: m.tensors[n] for n in out}
        _finite(out)
        with self.lock:
            self.buckets[index] = ref.hex()
            self.tensors.update(out)
            self.verified.update(verified)
            if index == 0:
                self.manifest = own

    def finish(self, refs: list, engine: Served, delta: bool = False) -> FiniteTensors:
        """The full new state dict of the upload whose buckets are `refs` (`delta`: a push with a base version), every
        check run over the whole push."""
        for i, ref in enumerate(refs):
            if self.buckets.get(i) != ref.hex():
                self.add(i, ref, self.manifest, engine)
        if set(self.buckets) != set(range(len(refs))):
            raise WeightsRejected(f"{len(self.buckets)} buckets were staged, the upload has {len(refs)}")
        m, out = self.manifest, FiniteTensors(self.tensors)
        if m is None:
            if delta:
                raise WeightsRejected("a push with a base version needs a manifest")
            if self.verified:
                raise WeightsRejected("tensors were checked against a manifest the upload does not carry")
            return out
        sent = {n: e for n, e in m.tensors.items() if e[1] != "same"}
        if self.verified != sent or out.keys() != sent.keys():
            raise WeightsRejected("the tensors staged are not the ones the manifest names, with its checksums")
        same = [n for n, (_, e) in m.tensors.items() if e == "same"]
        if m.base is not None:
            _base_served(m, engine)
        if same:
            served = _served(m, engine)
            part = {n: served[n] for n in same}
            _checked(m, dict.fromkeys(same, "same"), part)
            _finite(part)
            out.update(part)
        return out
