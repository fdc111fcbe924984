"""Delta encoding, buckets and manifests in process: round trips bit-exact, and every corruption caught."""

import asyncio
import zlib

import numpy as np
import pytest
import torch
from safetensors.torch import load, save

from rollout_farm.services.weights.buckets import buckets, full_payloads, header, plan, size, views
from rollout_farm.services.weights.checks import WeightsError, parse_header, payload_size
from rollout_farm.services.weights.delta import DeltaError, decode, encode
from rollout_farm.services.weights.manifest import Manifest, digest, manifest_of, tensor_bytes
from rollout_farm.services.weights.stream import Body, check_bucket, check_complete, receive


@pytest.fixture(autouse=True)
def seeded():
    """Seeded: every test's random tensors come from torch's generator set to 0 (restored after the test)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def step(t: torch.Tensor, lr: float = 2e-5, seed: int = 0) -> torch.Tensor:
    """An Adam-like step: every element moves by about lr."""
    g = torch.Generator().manual_seed(seed)
    return t - lr * torch.sign(torch.randn(t.shape, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_delta_round_trip_is_bit_exact_and_smaller_after_a_small_step(dtype):
    base = (torch.randn(256, 64) * 0.05).to(dtype)
    new = step(base.float()).to(dtype)
    payload = encode(new, base)
    out = decode(payload, base)
    assert out.dtype == dtype and out.shape == base.shape
    assert bytes(tensor_bytes(out)) == bytes(tensor_bytes(new))
    if dtype == torch.float32:
        assert len(payload) < 0.8 * new.numel() * 4  # the high byte planes of the XOR are nearly all zero


def test_delta_of_an_unchanged_tensor_is_tiny_and_decodes():
    base = torch.randn(1000)
    payload = encode(base.clone(), base)
    assert len(payload) < 100
    assert torch.equal(decode(payload, base), base)


def test_negative_control_a_delta_against_the_wrong_base_gives_other_bytes_and_another_checksum():
    base, other = torch.randn(512), torch.randn(512)
    new = step(base)
    rebuilt = decode(encode(new, base), other)
    assert digest("xxh3_128", tensor_bytes(rebuilt)) != digest("xxh3_128", tensor_bytes(new))
    assert digest("sha256", tensor_bytes(rebuilt)) != digest("sha256", tensor_bytes(new))


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda p: p[:-3],  # cut
        lambda p: p + b"\0",  # trailing bytes
        lambda p: bytes([2]) + p[1:],  # wrong item size
        lambda p: p[:1] + bytes([7]) + p[2:],  # unknown plane kind
    ],
)
def test_malformed_deltas_are_refused(corrupt):
    base = torch.randn(300)
    with pytest.raises(DeltaError):
        decode(corrupt(encode(step(base), base)), base)


def test_a_plane_that_inflates_past_its_size_is_refused_without_inflating_it():
    base = torch.zeros(1000, dtype=torch.uint8)
    bomb = zlib.compress(b"\0" * 10_000_000)
    payload = bytes([1, 1]) + len(bomb).to_bytes(4, "little") + bomb
    with pytest.raises(DeltaError, match="past"):
        decode(payload, base)


def test_checksums_tell_one_flipped_bit():
    t = torch.randn(4096)
    u = t.clone()
    u.view(torch.int32)[123] ^= 1
    for algorithm in ("xxh3_128", "blake2b_128", "sha256"):
        assert digest(algorithm, tensor_bytes(t)) != digest(algorithm, tensor_bytes(u))
        assert digest(algorithm, tensor_bytes(t)) == digest(algorithm, tensor_bytes(t.clone()))


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(64, 32, generator=g),
        "b.weight": torch.randn(100, generator=g).to(torch.bfloat16),
        "c.bias": torch.randn(7, generator=g),
        "d.weight": torch.randn(300, 10, generator=g),
    }


def test_buckets_are_safetensors_files_and_views_read_them_back_without_a_copy():
    tensors = state()
    m = manifest_of(tensors)
    body = b"".join(bytes(p) for p in buckets(full_payloads(tensors), m, bucket_bytes=4096))
    assert len(body) == size(full_payloads(tensors), m, 4096)
    # split the body at each bucket's end, as the ingress does; each is a plain safetensors file
    got, at, n_buckets = {}, 0, 0
    while at < len(body):
        n = int.from_bytes(body[at : at + 8], "little")
        end = at + 8 + n + payload_size(parse_header(body[at + 8 : at + 8 + n])[1])
        buf = np.frombuffer(body[at:end], np.uint8)
        tensors_i, meta = views(buf)
        assert load(body[at:end]).keys() == tensors_i.keys()  # safetensors itself reads the bucket
        assert (meta.get("farm") is not None) == (n_buckets == 0)
        for name, t in tensors_i.items():
            assert t.untyped_storage().data_ptr() >= buf.ctypes.data  # a view into the bucket
        got.update(tensors_i)
        at, n_buckets = end, n_buckets + 1
    assert n_buckets >= 3
    assert {k: bytes(tensor_bytes(v)) for k, v in got.items()} == {
        k: bytes(tensor_bytes(v)) for k, v in tensors.items()
    }


def test_plan_bounds_the_bytes_of_each_bucket():
    groups = plan({"a": 10, "b": 10, "c": 25, "d": 1}, bucket_bytes=20)
    assert groups == [["a", "b"], ["c"], ["d"]]


def spec_of(tensors):
    from rollout_farm.services.weights.state_dict import spec_of as s

    return s(tensors)


async def chunks(data: bytes, n: int = 1000):
    for i in range(0, len(data), n):
        yield data[i : i + n]


def received(body: bytes, spec, limit: int = 1 << 30):
    from rollout_farm.services.errors import TooLarge

    return asyncio.run(receive(Body(chunks(body), limit, TooLarge("too large"), hashed=True), spec))


def test_the_ingress_reads_buckets_and_a_plain_safetensors_file(monkeypatch):
    import ray

    puts = []
    monkeypatch.setattr(ray, "put", lambda x: puts.append(x) or len(puts))
    tensors = state()
    spec = spec_of(tensors)
    got = received(save(tensors), spec)
    assert got.refs == [1] and got.names == tensors.keys() and got.manifest is None
    body = b"".join(bytes(p) for p in buckets(full_payloads(tensors), manifest_of(tensors), 2048))
    got = received(body, spec)
    assert len(got.refs) >= 3 and got.manifest is not None and got.bytes == len(body)
    assert b"".join(p.tobytes() for p in puts[1:]) == body  # the buckets, byte for byte


@pytest.mark.parametrize(
    "cut,words",
    [
        (lambda b: b[: len(b) // 2], "cut"),
        (lambda b: b + b"\1\2\3", "cut"),  # garbage after the last bucket
        (lambda b: b"\xff" * 8 + b[8:], "header"),
        (lambda b: b"", "empty"),
    ],
)
def test_cut_or_garbled_bodies_are_refused(monkeypatch, cut, words):
    import ray

    monkeypatch.setattr(ray, "put", lambda x: 0)
    tensors = state()
    body = b"".join(bytes(p) for p in buckets(full_payloads(tensors), None, 2048))
    with pytest.raises(WeightsError, match=words):
        received(cut(body), spec_of(tensors))


def test_a_body_over_the_limit_is_refused_as_it_streams(monkeypatch):
    import ray

    from rollout_farm.services.errors import TooLarge

    monkeypatch.setattr(ray, "put", lambda x: 0)
    with pytest.raises(TooLarge):
        received(save(state()), spec_of(state()), limit=1000)
    # a header that declares a huge delta tensor: refused before anything of that size is allocated
    m = Manifest("xxh3_128", 1, {n: ("00", "same") for n in state()})
    m.tensors["a.weight"] = ("00", "xor")
    huge = header([("a.weight", "U8", [1 << 60], 1 << 60)], m)
    with pytest.raises(TooLarge):
        received(huge, spec_of(state()), limit=1 << 30)


def test_manifest_checks():
    tensors = state()
    spec = spec_of(tensors)
    m = Manifest("xxh3_128", 3, {n: ("00", "same") for n in tensors})
    m.tensors["a.weight"] = ("00", "xor")
    assert check_bucket(spec, {"a.weight": ([12], "U8")}, m, set()) == []
    assert "1-D U8" in check_bucket(spec, {"a.weight": ([64, 32], "F32")}, m, set())[0]
    assert "'same'" in check_bucket(spec, {"c.bias": ([7], "F32")}, m, set())[0]
    assert "twice" in check_bucket(spec, {"a.weight": ([12], "U8")}, m, {"a.weight"})[0]
    with pytest.raises(WeightsError, match="no base"):
        Manifest.from_metadata({"farm": Manifest("xxh3_128", None, {"a": ("00", "same")}).to_json()})
    with pytest.raises(WeightsError, match="not a manifest"):
        Manifest.from_metadata({"farm": "[1, 2]"})
    incomplete = Manifest("xxh3_128", 3, {"a.weight": ("00", "full")})
    from rollout_farm.services.weights.stream import Received

    problems = check_complete(spec, Received(manifest=incomplete, names={"a.weight"}))
    assert any("leaves out tensor 'b.weight'" in p for p in problems)


def test_header_is_padded_to_eight_bytes():
    h = header([("x", "F32", [3], 12)])
    assert (len(h) - 8) % 8 == 0 and int.from_bytes(h[:8], "little") == len(h) - 8
