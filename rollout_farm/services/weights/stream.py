"""The ingress's side of an upload: the body streamed once, bucket by bucket, into the Ray object store.

Each bucket (rollout_farm/services/weights/buckets.py) is read straight into one numpy array of its exact size (its
header says it), checked against the model (names, shapes, dtypes, byte ranges; the manifest's encodings) and `ray.put`
once; the array is dropped then, so the ingress holds at most one bucket. Each bucket is handed on (`on_bucket`) as soon
as it is in the store, so the replicas stage it while the next one streams. The replicas map the object read-only (a
numpy array crosses the object store without a copy) and view its tensors in place. Only JSON headers are parsed
here: nothing from the network is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import ray

from rollout_farm.services.errors import Invalid, TooLarge
from rollout_farm.services.weights import probe as probes
from rollout_farm.services.weights.checks import WeightsError, check_state_dict, parse_header, payload_size
from rollout_farm.services.weights.manifest import Manifest
from rollout_farm.services.weights.probe import Probe

MAX_HEADER = 100 << 20  # safetensors' own limit on a header


class Body:
    """request.stream() read exactly: n bytes at a time, or straight into a buffer; counted against `limit` (413
    naming the setting) and hashed with SHA-256 when `hashed`."""

    def __init__(self, chunks: AsyncIterator[bytes], limit: int, too_large: TooLarge, hashed: bool):
        self.chunks, self.limit, self.too_large = chunks, limit, too_large
        self.sha = hashlib.sha256() if hashed else None
        self.pending, self.count, self.done = memoryview(b""), 0, False

    async def _more(self) -> bool:
        while not self.pending and not self.done:
            try:
                chunk = await self.chunks.__anext__()
            except StopAsyncIteration:
                self.done = True
                break
            self.count += len(chunk)
            if self.count > self.limit:
                raise self.too_large
            if self.sha:
                self.sha.update(chunk)
            self.pending = memoryview(chunk)
        return bool(self.pending)

    async def at_end(self) -> bool:
        return not await self._more()

    async def readinto(self, out: memoryview, what: str) -> None:
        at = 0
        while at < len(out):
            if not await self._more():
                raise WeightsError([f"the body ends {len(out) - at} bytes into {what}: the upload was cut"])
            n = min(len(out) - at, len(self.pending))
            out[at : at + n] = self.pending[:n]
            self.pending, at = self.pending[n:], at + n

    async def read(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        await self.readinto(memoryview(buf), what)
        return bytes(buf)


@dataclass
class Received:
    refs: list = field(default_factory=list)  # one ObjectRef per bucket (a numpy uint8 array)
    manifest: Manifest | None = None
    probe: Probe | None = None  # in the first bucket's __metadata__ (rollout_farm/services/weights/probe.py)
    names: set[str] = field(default_factory=set)  # the tensors whose bytes came
    bytes: int = 0
    sha256: str | None = None


def check_bucket(spec: dict, got: dict, manifest: Manifest | None, seen: set[str]) -> list[str]:
    """What is wrong with a bucket's tensors (name -> (shape, dtype)) given the model's spec and the manifest."""
    problems = [f"tensor {n!r} comes twice" for n in got if n in seen]
    xor = {n for n, (_, e) in (manifest.tensors.items() if manifest else ()) if e == "xor"}
    for n in got.keys() & xor:
        if got[n][1] != "U8" or len(got[n][0]) != 1:
            problems.append(f"tensor {n!r} is a delta (xor in the manifest): send it as 1-D U8")
    if manifest is not None:
        problems += [f"tensor {n!r} is not in the manifest" for n in got if n not in manifest.tensors]
        same = got.keys() - manifest.sent()
        problems += [f"tensor {n!r} is 'same' in the manifest, but its bytes came" for n in same]
    plain = {n: v for n, v in got.items() if n not in xor}
    problems += [p for p in check_state_dict(spec, plain) if not p.startswith("missing tensor")]
    return problems


def check_complete(spec: dict, received: Received) -> list[str]:
    """A push must account for every tensor of the model: sent, or (with a base) named unchanged in the manifest."""
    m = received.manifest
    if m is None or m.base is None:
        return [f"missing tensor {n!r}" for n in sorted(spec.keys() - received.names)][:20]
    problems = [f"the manifest leaves out tensor {n!r}" for n in sorted(spec.keys() - m.tensors.keys())]
    problems += [f"the manifest names tensor {n!r}, which the model has not" for n in sorted(m.tensors.keys() - spec)]
    problems += [f"missing tensor {n!r} (the manifest says it is sent)" for n in sorted(m.sent() - received.names)]
    return problems[:20]


OnManifest = Callable[[Manifest | None], Awaitable] | None
OnBucket = Callable[[int, object, set[str], Manifest | None], Awaitable] | None


async def receive(body: Body, spec: dict, on_manifest: OnManifest = None, on_bucket: OnBucket = None) -> Received:
    """Every bucket of the body into the object store; WeightsError (a 422) on the first problem. `on_manifest` sees
    the manifest as soon as the first header has come (before any tensor bytes), and may refuse the push;
    `on_bucket` sees each bucket once it is in the store (its index, ObjectRef, tensor names and the manifest)."""
    out = Received()
    while not await body.at_end():
        first = not out.refs
        n = int.from_bytes(await body.read(8, "a bucket's header length"), "little")
        if n > MAX_HEADER:
            raise WeightsError([f"a bucket header of {n} bytes: not a safetensors file (headers stay under 100 MB)"])
        raw = await body.read(n, "a bucket's header")
        got, offsets, metadata = parse_header(raw, None)
        if first:
            out.manifest = Manifest.from_metadata(metadata)
            out.probe = probes.parse(metadata.get(probes.META_KEY))  # a malformed one: 422 naming probe.<field>
            if on_manifest is not None:
                await on_manifest(out.manifest)
        elif metadata.get("farm") is not None or metadata.get(probes.META_KEY) is not None:
            raise WeightsError(["the manifest and the probe must be in the first bucket"])
        if problems := check_bucket(spec, got, out.manifest, out.names):
            raise WeightsError(problems)
        if body.count - len(body.pending) + payload_size(offsets) > body.limit:  # before allocating it
            raise body.too_large
        buf = np.empty(8 + n + payload_size(offsets), np.uint8)
        buf[:8] = np.frombuffer(n.to_bytes(8, "little"), np.uint8)
        buf[8 : 8 + n] = np.frombuffer(raw, np.uint8)
        await body.readinto(memoryview(buf)[8 + n :], f"bucket {len(out.refs) + 1}")
        out.refs.append(ray.put(buf))
        out.names |= got.keys()
        del buf
        if on_bucket is not None:
            await on_bucket(len(out.refs) - 1, out.refs[-1], set(got), out.manifest)
    if not out.refs:
        raise WeightsError(["the body is empty: send a safetensors file"])
    if problems := check_complete(spec, out):
        raise WeightsError(problems)
    out.bytes, out.sha256 = body.count, body.sha.hexdigest() if body.sha else None
    return out


def check_sha256(declared: str | None, actual: str) -> None:
    """422 when the client's x-content-sha256 differs from the body's."""
    if declared and not hmac.compare_digest(declared.lower(), actual):
        raise Invalid(
            [
                {
                    "field": "x-content-sha256",
                    "message": f"body has SHA-256 {actual}, not {declared}: the upload was damaged; send it again",
                }
            ]
        )
