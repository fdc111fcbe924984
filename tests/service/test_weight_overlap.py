"""An upload staged while it streams (rollout_farm/services/weights/early.py): the replicas check each bucket as it
arrives, so a bad bucket is refused before the upload ends, and an upload refused or cut at any point leaves every
replica on the version it served, with the push lock free for the next push.

The uploads here go over a raw socket, bucket by bucket, so that a test controls when each bucket arrives and can
stop before the body ends."""

import select
import socket
import time
from urllib.parse import urlparse

import pytest
import torch
from safetensors.torch import load_file

from rollout_farm.services.weights.buckets import buckets, full_payloads
from rollout_farm.services.weights.checks import parse_header, payload_size
from rollout_farm.services.weights.manifest import manifest_of
from tests.conftest import TOKEN
from tests.service.helpers import greedy, push, rollout, tokens, versions

PROMPTS = [[40, 41, 42], [43, 44, 45]]
BUCKET = 1 << 15


def split(body: bytes) -> list[bytes]:
    """A body cut at each bucket's end (each bucket says its own length)."""
    out, at = [], 0
    while at < len(body):
        n = int.from_bytes(body[at : at + 8], "little")
        end = at + 8 + n + payload_size(parse_header(body[at + 8 : at + 8 + n])[1])
        out.append(body[at:end])
        at = end
    return out


def names_in(bucket: bytes) -> list[str]:
    n = int.from_bytes(bucket[:8], "little")
    return list(parse_header(bucket[8 : 8 + n])[0])


def upload(state: dict, manifest_state: dict | None = None) -> list[bytes]:
    """`state` as many buckets, with the manifest (per-tensor checksums) of `manifest_state` (default: `state`)."""
    manifest = manifest_of(manifest_state if manifest_state is not None else state)
    return split(b"".join(bytes(p) for p in buckets(full_payloads(state), manifest, BUCKET)))


class Upload:
    """POST /v1/weights over a raw socket, its body sent bucket by bucket."""

    def __init__(self, service: str, version: int, size: int):
        url = urlparse(service)
        self.sock = socket.create_connection((url.hostname, url.port), timeout=60)
        head = (
            f"POST /v1/weights?version={version} HTTP/1.1\r\nHost: {url.hostname}\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {size}\r\n\r\n"
        )
        self.sock.sendall(head.encode())

    def answered(self, wait_s: float) -> bool:
        return bool(select.select([self.sock], [], [], wait_s)[0])

    def response(self) -> tuple[int, str]:
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < self._length(data):
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), body.decode(errors="replace")

    @staticmethod
    def _length(data: bytes) -> int:
        for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == b"content-length":
                return int(value)
        return 1 << 62


@pytest.fixture
def base_state(tiny_model):
    return load_file(tiny_model / "model.safetensors")


@pytest.mark.parametrize("breakage,words", [("nan", "1 NaN"), ("damaged", "damaged")])
def test_a_bad_first_bucket_is_refused_before_the_upload_ends(service, fresh_weights, base_state, breakage, words):
    """NaN in the first bucket, or bytes that differ from their checksum there: the replicas refuse it while it
    streams (the body never ends here), naming the tensor, and nothing changes."""
    before = tokens(rollout(service, greedy(PROMPTS)))
    state = {k: v.clone() for k, v in base_state.items()}
    clean = upload(state)
    name = names_in(clean[0])[0]
    state[name].view(-1)[0] = float("nan") if breakage == "nan" else state[name].view(-1)[0] + 1
    parts = upload(state, state if breakage == "nan" else base_state)
    assert len(parts) >= 6 and names_in(parts[0])[0] == name
    up = Upload(service, fresh_weights + 1, sum(map(len, parts)))
    for part in parts[:-1]:  # never the last bucket: only a refusal while it streams can answer
        up.sock.sendall(part)
        if up.answered(0.3):
            break
    assert up.answered(120), "no answer while the upload was still streaming"
    status, text = up.response()
    assert status == 422 and words in text and repr(name) in text, text
    now = versions(service)
    assert now["version"] == fresh_weights and set(now["replicas"].values()) == {fresh_weights}
    assert len(now["replicas"]) == 2
    assert tokens(rollout(service, greedy(PROMPTS))) == before


def test_an_upload_cut_mid_stream_changes_nothing_and_frees_the_push_lock(service, fresh_weights, base_state):
    """The client goes away after half of its buckets (each staged on every replica by then): every replica stays
    on its version, and the next push goes through at once (the lock is released, the staged buckets dropped)."""
    before = tokens(rollout(service, greedy(PROMPTS)))
    torch.manual_seed(3)
    changed = {k: v + 0.5 * torch.randn_like(v) for k, v in base_state.items()}
    parts = upload(changed)
    up = Upload(service, fresh_weights + 1, sum(map(len, parts)))
    for part in parts[: len(parts) // 2]:
        up.sock.sendall(part)
        time.sleep(0.05)
    time.sleep(1)  # the buckets sent are staged on the replicas
    up.sock.close()
    now = versions(service)
    assert now["version"] == fresh_weights and set(now["replicas"].values()) == {fresh_weights}
    assert tokens(rollout(service, greedy(PROMPTS))) == before
    t = time.monotonic()
    r = push(service, b"".join(upload(changed)), fresh_weights + 1)
    assert r.status_code == 200, r.text
    assert time.monotonic() - t < 120  # not a wait for the lock to expire
    now = versions(service)
    assert set(now["replicas"].values()) == {fresh_weights + 1} and len(now["replicas"]) == 2
    assert tokens(rollout(service, greedy(PROMPTS))) != before
