"""Streamed, bucketed and delta weight pushes against the real service: bit-exact on every replica, atomic, and a push
that does not apply to the served weights refused with a 409 naming the fix (the pusher then sends it in full).

Bit-exactness is read back through the replicas' own checksums: a bucketed push that sends nothing (every tensor
"same") succeeds only if every replica's every tensor has the client's checksum."""

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmError
from rollout_farm.services.weights.buckets import buckets, full_payloads, size
from rollout_farm.services.weights.checks import parse_header, payload_size
from rollout_farm.services.weights.delta import encode
from rollout_farm.services.weights.manifest import Manifest, manifest_of
from rollout_farm.services.weights.pusher import WeightPusher
from tests.conftest import MAX_WEIGHTS_BYTES, TOKEN
from tests.service.helpers import AUTH, greedy, replace_an_engine_replica, rollout, tokens, versions

PROMPTS = [[40, 41, 42], [43, 44, 45], [7, 8, 9, 10]]


def stepped(state: dict, seed: int, lr: float = 2e-5) -> dict:
    """An Adam-like step of size lr on every tensor, as one training step makes."""
    g = torch.Generator().manual_seed(seed)
    return {k: v - lr * torch.sign(torch.randn(v.shape, generator=g)) for k, v in state.items()}


def body_of(tensors: dict, manifest: Manifest | None, bucket_bytes: int = 1 << 16) -> bytes:
    payloads = full_payloads(tensors)
    return b"".join(bytes(p) for p in buckets(payloads, manifest, bucket_bytes))


def post(service: str, body: bytes, version: int) -> httpx.Response:
    return httpx.post(f"{service}/v1/weights", params={"version": version}, content=body, headers=AUTH, timeout=300)


def assert_every_replica_serves(client, state: dict, version: int) -> int:
    """Every replica serves `version`, and its tensors have `state`'s checksums (an all-"same" push says so); returns
    the version that check pushed."""
    now = client.weights_version()
    assert now.version == version and set(now.replicas.values()) == {version} and len(now.replicas) == 2
    check = WeightPusher(client, "bucketed")
    check.remember(state, version)
    r = check.push(state, version + 1)
    assert r.sent_tensors == 0 and r.base == version and check.last["mode"] == "bucketed"
    return version + 1


@pytest.fixture
def base_state(client, tiny_model):
    return load_file(tiny_model / "model.safetensors")


def test_streamed_buckets_land_bit_exact_on_every_replica(service, client, fresh_weights, base_state):
    before = tokens(rollout(service, greedy(PROMPTS)))
    new = stepped(base_state, seed=1, lr=0.05)
    pusher = WeightPusher(client, "full", bucket_bytes=1 << 16)  # many buckets
    r = pusher.push(new, fresh_weights + 1)
    assert r.version == fresh_weights + 1 and r.base is None and r.sent_tensors == len(new)
    assert r.bytes == size(full_payloads(new), manifest_of(new), 1 << 16)
    after = tokens(rollout(service, greedy(PROMPTS)))
    assert after != before
    for _ in range(3):  # requests spread over both replicas: the same greedy tokens
        assert tokens(rollout(service, greedy(PROMPTS))) == after
    assert_every_replica_serves(client, new, fresh_weights + 1)


@pytest.mark.parametrize("mode", ["bucketed", "delta"])
def test_pushes_with_a_base_end_bit_exact_and_send_fewer_bytes(client, fresh_weights, base_state, mode):
    pusher = WeightPusher(client, mode, bucket_bytes=1 << 16)
    full = pusher.push(base_state, fresh_weights + 1)
    state, version = dict(base_state), fresh_weights + 1
    for seed in (2, 3):
        changed = stepped({k: v for k, v in state.items() if "layers.0." in k}, seed)
        state = {**state, **changed}  # a step that changes some tensors
        version += 1
        r = pusher.push(state, version)
        assert r.base == version - 1 and pusher.last["mode"] == mode and not pusher.last["fallback"]
        assert r.sent_tensors == len(changed) and r.bytes < full.bytes
        if mode == "delta":  # the XOR of a small step compresses
            assert r.bytes < 0.8 * sum(v.numel() * v.element_size() for v in changed.values())
    assert_every_replica_serves(client, state, version)


def test_a_push_on_the_wrong_base_is_409_and_the_pusher_falls_back_to_full(service, client, fresh_weights, base_state):
    before = tokens(rollout(service, greedy(PROMPTS)))
    pusher = WeightPusher(client, "delta")
    pusher.push(base_state, fresh_weights + 1)
    layer0 = {k: v for k, v in base_state.items() if "layers.0." in k}
    new = {**base_state, **stepped(layer0, seed=4, lr=0.05)}  # a delta of a few tensors, unless refused
    # a base version the replicas do not serve: refused, naming the fix
    manifest = manifest_of(new, base=fresh_weights)
    manifest.tensors = {n: (h, "same") for n, (h, _) in manifest.tensors.items()}
    r = post(service, body_of({}, manifest), fresh_weights + 2)
    assert r.status_code == 409 and "send a full push" in r.text and r.json()["detail"][0]["field"] == "base", r.text
    # the served base, but the checksums are of other weights: every replica rebuilds, none matches, all discard
    manifest.base = fresh_weights + 1
    r = post(service, body_of({}, manifest), fresh_weights + 2)
    assert r.status_code == 409 and "send a full push" in r.text, r.text
    # a delta against the wrong base bytes: decoded fine, checksum wrong on every replica
    first = next(iter(new))
    wrong = encode(new[first], torch.zeros_like(new[first]))
    manifest.tensors[first] = (manifest.tensors[first][0], "xor")
    payloads = {first: ("U8", [len(wrong)], memoryview(wrong))}
    body = b"".join(bytes(p) for p in buckets(payloads, manifest, 1 << 16))
    r = post(service, body, fresh_weights + 2)
    assert r.status_code == 409 and "do not match" in r.text, r.text
    now = versions(service)
    assert now["version"] == fresh_weights + 1 and set(now["replicas"].values()) == {fresh_weights + 1}
    # the pusher believes the replicas serve another version: its delta is refused, it sends the push in full
    pusher.version = fresh_weights
    r = pusher.push(new, fresh_weights + 2)
    assert r.version == fresh_weights + 2 and r.base is None and pusher.last["fallback"]
    assert tokens(rollout(service, greedy(PROMPTS))) != before
    assert_every_replica_serves(client, new, fresh_weights + 2)


def test_a_later_bucket_that_fails_leaves_every_replica_on_the_old_version(service, client, fresh_weights, base_state):
    before = tokens(rollout(service, greedy(PROMPTS)))
    names = list(base_state)
    for breakage, status, words in (
        ("nan", 422, "NaN"),  # the replicas refuse the last bucket at staging
        ("damaged", 422, "damaged"),  # its bytes differ from their checksum
        ("shape", 422, "shape"),  # the ingress refuses it before any replica sees it
    ):
        state = {k: v.clone() for k, v in base_state.items()}
        manifest = manifest_of(state)
        last = names[-1]
        if breakage == "nan":
            state[last].view(-1)[0] = float("nan")
            manifest = manifest_of(state)
        elif breakage == "damaged":
            state[last].view(-1)[0] += 1
        else:
            state[last] = torch.zeros(3, 3)
        body = body_of(state, manifest, bucket_bytes=1 << 15)
        assert body.count(b'"data_offsets"') == len(names) and len(body) > 4 * (1 << 15)  # several buckets
        r = post(service, body, fresh_weights + 1)
        assert r.status_code == status and words in r.text and repr(last) in r.text, r.text
        now = versions(service)
        assert now["version"] == fresh_weights and set(now["replicas"].values()) == {fresh_weights}
    assert tokens(rollout(service, greedy(PROMPTS))) == before


def test_cut_garbled_and_oversized_bucketed_bodies_change_nothing(service, fresh_weights, base_state):
    body = body_of(base_state, manifest_of(base_state), bucket_bytes=1 << 15)
    n = int.from_bytes(body[:8], "little")
    second = 8 + n + payload_size(parse_header(body[8 : 8 + n])[1]) + 8  # the second bucket's header
    for bad, status, words in (
        (body[: len(body) - 100], 422, "cut"),
        (body[:second] + b"\xff" * 40 + body[second + 40 :], 422, "header"),
        (body + b"\0" * 5, 422, "cut"),
    ):
        r = post(service, bad, fresh_weights + 1)
        assert r.status_code == status and words in r.text, r.text
    padded = body[8 : 8 + n] + b" " * MAX_WEIGHTS_BYTES  # a valid header, padded past the limit
    huge = len(padded).to_bytes(8, "little") + padded + body[8 + n :]
    r = httpx.post(
        f"{service}/v1/weights",
        params={"version": fresh_weights + 1},
        content=iter([huge[i : i + (1 << 20)] for i in range(0, len(huge), 1 << 20)]),  # chunked: counted as it comes
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=300,
    )
    assert r.status_code == 413 and "FARM_MAX_WEIGHTS_BYTES" in r.text, r.text
    assert versions(service)["version"] == fresh_weights


def test_an_engine_that_cannot_export_its_weights_refuses_a_delta(bench_service):
    from rollout_farm.services.client import FarmClient

    with FarmClient(bench_service, TOKEN, retries=0) as c:
        version = c.weights_version().version
        state = {"bench.weight": torch.ones(1)}
        pusher = WeightPusher(c, "bucketed")
        pusher.push(state, version + 1)
        manifest = manifest_of(state, base=version + 1)
        manifest.tensors = {n: (h, "same") for n, (h, _) in manifest.tensors.items()}
        with pytest.raises(FarmError) as e:
            c.push_pieces(lambda: buckets({}, manifest, 1 << 16), size({}, manifest, 1 << 16), version + 2)
        assert e.value.status == 409 and "cannot apply a push with a base" in str(e.value.body)
        assert "send a full push" in str(e.value.body)
        r = pusher.push({"bench.weight": torch.zeros(1)}, version + 2)  # everything changed: sent in full
        assert r.version == version + 2 and r.base is None and pusher.last["mode"] == "full"
        assert P.WeightsVersion.model_validate(c.weights_version()).version == version + 2


def test_a_restarted_replica_replays_the_deltas_since_the_last_full_push(client, fresh_weights, base_state):
    """The store keeps the last full push and the deltas since; a replica Serve starts anew applies them in order and
    serves the newest version bit-exact."""

    pusher = WeightPusher(client, "delta")
    state, version = stepped(base_state, seed=5, lr=0.05), fresh_weights + 1
    pusher.push(state, version)
    for seed in (6, 7):
        state, version = stepped(state, seed), version + 1
        assert pusher.push(state, version).base == version - 1
    replace_an_engine_replica(client)
    assert_every_replica_serves(client, state, version)
