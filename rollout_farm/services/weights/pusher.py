"""The client's side of weight pushes from a state dict in memory: full, bucketed or delta, with a fallback to full.

  full      every tensor, in buckets of at most bucket_bytes, streamed from the tensors' own memory (nothing is
            serialized into a copy), with a manifest of per-tensor checksums that every replica verifies
  bucketed  only the tensors whose checksum changed since the last push; the others are "same" in the manifest
  delta     changed tensors as XOR against the last push, byte planes compressed
  (rollout_farm/services/weights/delta.py); a
            tensor whose delta would not be smaller goes in full

bucketed and delta name the last pushed version as their base. A 409 on field `base` (a replica missed that version,
or the store's chain of deltas is full) makes the pusher send the same version again in full. The pusher keeps the
last pushed checksums, and for delta a CPU copy of the last pushed tensors (one model's worth of memory).

A push may carry a probe (rollout_farm/services/weights/probe.py): `compute_probe` scores a few token sequences with
the model pushed, and the pusher puts the probe in the first bucket's `__metadata__`; every replica scores it on the
staged weights before the commit, and a mismatch refuses the push everywhere (a 422 on `probe`).
"""

from __future__ import annotations

import json

import torch

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient, FarmError
from rollout_farm.services.weights.buckets import BUCKET_BYTES, buckets, full_payloads, size
from rollout_farm.services.weights.delta import encode
from rollout_farm.services.weights.manifest import Manifest, default_hash, digest, tensor_bytes
from rollout_farm.services.weights.probe import DEFAULT_TOLERANCE

MODES = ("full", "bucketed", "delta")
DELTA_KEEP = 0.9  # send a tensor in full when its delta is not below this share of its bytes


def base_refused(e: FarmError) -> bool:
    """A 409 that says the push does not apply to the served weights: send a full push instead."""
    body = e.body if isinstance(e.body, dict) else {}
    return e.status == 409 and any(d.get("field") == "base" for d in body.get("detail") or [])


def compute_probe(model: torch.nn.Module, sequences: list[list[int]], tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """A probe (rollout_farm/services/weights/probe.py) for `sequences` from a torch causal LM as it is now (with its
    adapter, for a peft model): each token's logprob given the tokens before it, at temperature 1, in float32, in eval
    mode (no dropout; the model's mode is restored)."""
    training, logprobs = model.training, []
    model.eval()
    try:
        with torch.no_grad():
            for ids in sequences:
                x = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
                logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
                logprobs.append([None, *logp.gather(-1, x[0, 1:, None]).squeeze(-1).tolist()])
    finally:
        model.train(training)
    return {"sequences": [list(ids) for ids in sequences], "logprobs": logprobs, "tolerance": tolerance}


class _SendFull(Exception):
    """A push with a base would carry (nearly) the whole model: a full push is as small and resets the store's chain."""


class WeightPusher:
    def __init__(
        self, client: FarmClient, mode: str = "full", bucket_bytes: int = BUCKET_BYTES, keep_copy: bool | None = None
    ):
        if mode not in MODES:
            raise ValueError(f"weight push mode {mode!r}: use one of {', '.join(MODES)}")
        self.client, self.mode, self.bucket_bytes = client, mode, bucket_bytes
        self.keep_copy = mode == "delta" if keep_copy is None else keep_copy
        self.hash = default_hash()
        self.version: int | None = None  # the last version this pusher pushed
        self.hashes: dict[str, str] = {}
        self.copy: dict[str, torch.Tensor] = {}  # delta: the last pushed tensors
        self.last: dict = {}  # the last push: mode sent, bytes, tensors sent, fallback
        self.probe: str | None = None  # the push's probe, as JSON, for its first bucket

    def push(
        self,
        tensors: dict[str, torch.Tensor],
        version: int,
        policy: P.InFlightPolicy = "finish",
        probe: dict | None = None,
    ) -> P.WeightsPushResponse:
        """Push `tensors` (the canonical state dict) as `version`, with `probe` (compute_probe's) if given."""
        self.probe = None if probe is None else json.dumps(probe)
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        hashes = {n: digest(self.hash, tensor_bytes(t)) for n, t in tensors.items()}
        fallback = False
        if self.mode != "full" and self.version is not None and hashes.keys() == self.hashes.keys():
            try:
                return self._done(tensors, hashes, self._push_base(tensors, hashes, version, policy), self.mode)
            except FarmError as e:
                if not base_refused(e):
                    raise
                fallback = True
            except _SendFull:
                pass
        payloads = full_payloads(tensors)
        manifest = Manifest(self.hash, None, {n: (h, "full") for n, h in hashes.items()})
        r = self._send(payloads, manifest, version, policy)
        return self._done(tensors, hashes, r, "full", fallback)

    def _push_base(self, tensors, hashes, version, policy) -> P.WeightsPushResponse:
        payloads, entries = {}, {}
        for n, t in tensors.items():
            if hashes[n] == self.hashes[n]:
                entries[n] = (hashes[n], "same")
                continue
            if self.mode == "delta" and n in self.copy:
                delta = encode(t, self.copy[n])
                if len(delta) < DELTA_KEEP * t.numel() * t.element_size():
                    payloads[n] = ("U8", [len(delta)], memoryview(delta))
                    entries[n] = (hashes[n], "xor")
                    continue
            payloads[n] = full_payloads({n: t})[n]
            entries[n] = (hashes[n], "full")
        full = sum(t.numel() * t.element_size() for t in tensors.values())
        if sum(len(p[2]) for p in payloads.values()) > DELTA_KEEP * full:  # (nearly) everything changed: send it full
            raise _SendFull()
        return self._send(payloads, Manifest(self.hash, self.version, entries), version, policy)

    def _send(self, payloads, manifest, version, policy) -> P.WeightsPushResponse:
        def pieces():
            return buckets(payloads, manifest, self.bucket_bytes, self.probe)

        n = size(payloads, manifest, self.bucket_bytes, self.probe)
        return self.client.push_pieces(pieces, n, version, policy)

    def _done(self, tensors, hashes, r: P.WeightsPushResponse, mode: str, fallback: bool = False):
        self.last = {"mode": mode, "bytes": r.bytes, "sent_tensors": r.sent_tensors, "fallback": fallback}
        self.remember(tensors, r.version, hashes)
        return r

    def remember(self, tensors: dict[str, torch.Tensor], version: int, hashes: dict[str, str] | None = None) -> None:
        """The service now serves `tensors` as `version` (pushed by this pusher, or by another route, e.g. a path)."""
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        self.version = version
        self.hashes = hashes or {n: digest(self.hash, tensor_bytes(t)) for n, t in tensors.items()}
        if self.keep_copy:
            for n, t in tensors.items():
                if n in self.copy and self.copy[n].shape == t.shape and self.copy[n].dtype == t.dtype:
                    self.copy[n].copy_(t)
                else:
                    self.copy[n] = t.clone()
