"""rollout_farm/services/weights/stage.py Staging: an upload staged bucket by bucket, in any order, then checked as a
whole push.

The buckets are real safetensors buckets (rollout_farm/services/weights/buckets.py); the object store is a dict (ray.get
of a reference that says its id)."""

import numpy as np
import pytest
import ray
import torch

from rollout_farm.services.weights.buckets import buckets, full_payloads
from rollout_farm.services.weights.checks import FiniteTensors, WeightsRejected, non_finite, parse_header, payload_size
from rollout_farm.services.weights.early import entries
from rollout_farm.services.weights.manifest import Manifest, manifest_of, tensor_bytes
from rollout_farm.services.weights.stage import BaseMismatch, Staging


class Ref:
    def __init__(self, data: bytes, tag: str):
        self.buf, self.tag = np.frombuffer(data, np.uint8), tag

    def hex(self) -> str:
        return self.tag


class Engine:
    def __init__(self, served: dict, version: int = 0):
        self.weight_version, self.served = version, served

    def served_tensors(self):
        return self.served


@pytest.fixture(autouse=True)
def store(monkeypatch):
    monkeypatch.setattr(ray, "get", lambda ref: ref.buf)


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}.weight": torch.randn(40, 40, generator=g) for i in range(8)}


def refs_of(tensors: dict, manifest: Manifest | None, tag: str = "") -> list[tuple[Ref, set[str]]]:
    """Each bucket as (reference, its tensor names)."""
    body = b"".join(bytes(p) for p in buckets(full_payloads(tensors), manifest, 8000))
    out, at = [], 0
    while at < len(body):
        n = int.from_bytes(body[at : at + 8], "little")
        spec, offsets, _ = parse_header(body[at + 8 : at + 8 + n])
        end = at + 8 + n + payload_size(offsets)
        out.append((Ref(body[at:end], f"{tag}{len(out)}"), set(spec)))
        at = end
    return out


def same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bytes(tensor_bytes(a[n])) == bytes(tensor_bytes(b[n])) for n in a)


def test_buckets_staged_early_in_any_order_make_the_whole_push():
    tensors = state()
    m = manifest_of(tensors)
    got = refs_of(tensors, m)
    assert len(got) >= 4
    staging, engine = Staging(5), Engine({})
    for i in [2, 0, 3]:  # out of order; bucket 1 and the rest never came early (a replica that joined late)
        staging.add(i, got[i][0], entries(m, got[i][1]), engine)
    out = staging.finish([r for r, _ in got], engine)
    assert isinstance(out, FiniteTensors) and non_finite(out) == [] and same_bytes(out, tensors)


def test_nan_in_a_bucket_staged_early_is_refused_there():
    """The engine does not look for NaN again in what finish() returns (a FiniteTensors): the bucket must."""
    tensors = state()
    tensors["t1.weight"][3, 3] = float("nan")
    m = manifest_of(tensors)
    got = refs_of(tensors, m)
    staging = Staging(5)
    with pytest.raises(WeightsRejected, match="'t1.weight' holds 1 NaN"):
        for i, (ref, names) in enumerate(got):
            staging.add(i, ref, entries(m, names), Engine({}))
    with pytest.raises(WeightsRejected, match="NaN"):  # and the same push staged in one go at the end
        Staging(5).finish([r for r, _ in got], Engine({}))
    assert non_finite({"x": tensors["t1.weight"]}) and not non_finite(FiniteTensors({"x": tensors["t1.weight"]}))


def test_a_damaged_bucket_and_a_manifest_that_disagrees_are_refused():
    tensors, engine = state(), Engine({})
    m = manifest_of(tensors)
    damaged = {k: v.clone() for k, v in tensors.items()}
    damaged["t5.weight"][0, 0] += 1
    got = refs_of(damaged, m)
    with pytest.raises(WeightsRejected, match="damaged"):
        Staging(5).finish([r for r, _ in got], engine)
    # the ingress handed a bucket entries the first bucket's manifest does not have: the whole push is refused
    got = refs_of(tensors, m)
    lying = Manifest(m.hash, None, {n: ("0" * 32, "full") for n in got[2][1]})
    staging = Staging(5)
    with pytest.raises(WeightsRejected, match="damaged"):  # its checksums do not match the bytes
        staging.add(2, got[2][0], lying, engine)
    staging = Staging(5)
    for i, (ref, names) in enumerate(got):
        staging.add(i, ref, entries(m, names), engine)
    staging.verified["t0.weight"] = ("0" * 32, "full")  # as if checked against entries the manifest does not have
    with pytest.raises(WeightsRejected, match="not the ones the manifest names"):
        staging.finish([r for r, _ in got], engine)


def test_a_cut_push_never_finishes():
    tensors = state()
    m = manifest_of(tensors)
    got = refs_of(tensors, m)
    staging, engine = Staging(5), Engine({})
    for i, (ref, names) in enumerate(got[:-1]):
        staging.add(i, ref, entries(m, names), engine)
    with pytest.raises(WeightsRejected, match="not the ones the manifest names"):  # the last bucket's tensors
        staging.finish([r for r, _ in got[:-1]], engine)


def test_a_bucketed_push_checks_its_base_and_its_same_tensors():
    served = state()
    new = {k: (v + 1 if k == "t0.weight" else v) for k, v in served.items()}
    m = manifest_of(new, base=7, encodings={k: "same" for k in new if k != "t0.weight"})
    got = refs_of({"t0.weight": new["t0.weight"]}, m)
    out = Staging(8).finish([r for r, _ in got], Engine(served, version=7), delta=True)
    assert same_bytes(out, new)
    with pytest.raises(BaseMismatch, match="base version 7"):
        Staging(8).finish([r for r, _ in got], Engine(served, version=6), delta=True)
    drifted = {**served, "t4.weight": served["t4.weight"] * 2}
    with pytest.raises(BaseMismatch, match="t4.weight"):
        Staging(8).finish([r for r, _ in got], Engine(drifted, version=7), delta=True)


class Replicas:
    """The ingress's handle, as EarlyStage calls it; a stage call either returns the replicas' errors or is cancelled,
    as Serve cancels a request's calls when its client goes away (a fake: no Serve app in a unit test)."""

    def __init__(self, cancel: bool):
        self.cancel, self.discarded = cancel, []

    async def errors(self, method, version, index, refs, manifest, timeout_s, setting):
        if self.cancel:
            raise ray.exceptions.TaskCancelledError()
        return []

    async def each(self, method, version):
        self.discarded.append((method, version))


@pytest.mark.parametrize("cancel", [False, True])
def test_a_bucket_call_cancelled_by_the_client_going_is_a_cut_upload_not_a_failure(cancel):
    import asyncio

    from rollout_farm.services.errors import ClientGone
    from rollout_farm.services.weights.early import EarlyStage

    async def push():
        replicas = Replicas(cancel)
        early = EarlyStage(replicas, 3, 10.0, "FARM_WEIGHT_SYNC_TIMEOUT_S", lambda errors: errors[0], hold=False)
        try:  # the cancelled call is seen at the next bucket, or at the end
            for i in range(2):
                await early.bucket(i, object(), {"t0.weight"}, None)
                await asyncio.sleep(0)
            await early.settle()
        except ClientGone:
            await early.abandon()
            return "cut", replicas.discarded
        return "staged", replicas.discarded

    outcome, discarded = asyncio.run(push())
    assert (outcome, discarded) == (("cut", [("discard", 3)]) if cancel else ("staged", []))


def test_a_push_cancelled_by_serve_logs_one_request_cut_line(caplog):
    """Serve cancels a request whose client went away; while the push waits for the lock or a bucket's staging no
    body read sees the disconnect, so rollout_farm/services/api/errors.py refusal_logged logs the cut itself (and lets
    the cancellation through). A refusal logs weight_push_refused instead (the control)."""
    import asyncio
    import logging

    from rollout_farm.services.api.errors import refusal_logged
    from rollout_farm.services.errors import Conflict

    async def push(error: BaseException):
        with refusal_logged("upload", 4):
            raise error

    with caplog.at_level(logging.WARNING, logger="farm.service"):
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(push(asyncio.CancelledError()))
        with pytest.raises(Conflict):
            asyncio.run(push(Conflict("version 4 is not newer")))
    assert [r.getMessage() for r in caplog.records] == ["request_cut", "weight_push_refused"]
