"""Weight pushes: validated and atomic, by upload (checksummed) or by folder; refused ones change nothing."""

import hashlib
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmError
from rollout_farm.services.weights.path_pusher import PathPusher
from rollout_farm.services.weights.pusher import compute_probe
from rollout_farm.services.weights.state_dict import canonical_state_dict
from rollout_farm.trainer.config import load
from rollout_farm.trainer.sync.probe import PushProbe, probe_refused
from rollout_farm.trainer.sync.weights import push_weights
from tests.conftest import MAX_WEIGHTS_BYTES, TOKEN
from tests.service.helpers import greedy, perturbed, push, push_path, request, rollout, tokens, versions


def test_weight_push_changes_outputs_and_increments_version(client, fresh_weights, tiny_model):
    greedy = P.RolloutRequest.model_validate(request(n=1, temperature=0))
    before = client.rollouts(greedy)
    state = load_file(tiny_model / "model.safetensors")
    torch.manual_seed(0)
    perturbed = {k: v + 0.5 * torch.randn_like(v) for k, v in state.items()}
    pushed = client.push_weights(save(perturbed), fresh_weights + 1)
    assert pushed.version == fresh_weights + 1 and pushed.tensors == len(state)
    version = client.weights_version()
    assert (
        version.version == fresh_weights + 1
        and set(version.replicas.values()) == {fresh_weights + 1}
        and len(version.replicas) == 2
    )
    after = client.rollouts(greedy)
    assert all(s.weight_version == fresh_weights + 1 for g in after.groups for s in g.samples)
    assert [g.samples[0].token_ids for g in after.groups] != [g.samples[0].token_ids for g in before.groups]
    # every replica serves the new weights: many small requests spread over both give the same greedy answers
    for _ in range(4):
        assert [g.samples[0].token_ids for g in client.rollouts(greedy).groups] == [
            g.samples[0].token_ids for g in after.groups
        ]


@pytest.mark.parametrize(
    "breakage,words",
    [
        (lambda s: {**s, "lm_head.weight": torch.zeros(7, 7)}, "shape"),
        (lambda s: {**s, "lm_head.weight": s["lm_head.weight"].half()}, "dtype"),
        (lambda s: {k: v for k, v in s.items() if k != "lm_head.weight"}, "missing tensor"),
        (lambda s: {**s, "extra.weight": torch.zeros(2)}, "unexpected tensor"),
    ],
)
def test_bad_push_is_refused_and_old_version_keeps_serving(client, fresh_weights, tiny_model, breakage, words):
    greedy = P.RolloutRequest.model_validate(request(n=1, temperature=0))
    before = client.rollouts(greedy)
    state = load_file(tiny_model / "model.safetensors")
    with pytest.raises(FarmError) as e:
        client.push_weights(save(breakage(state)), fresh_weights + 1)
    assert e.value.status == 422 and words in str(e.value.body)
    assert client.weights_version().version == fresh_weights
    after = client.rollouts(greedy)
    assert [g.samples[0].token_ids for g in after.groups] == [g.samples[0].token_ids for g in before.groups]
    assert all(s.weight_version == fresh_weights for g in after.groups for s in g.samples)


def test_cut_upload_and_stale_version_are_refused(client, fresh_weights, tiny_model):
    data = (tiny_model / "model.safetensors").read_bytes()
    with pytest.raises(FarmError) as e:
        client.push_weights(data[: len(data) // 2], fresh_weights + 1)
    assert e.value.status == 422 and "cut" in str(e.value.body)
    with pytest.raises(FarmError) as e:
        client.push_weights(data, fresh_weights)
    assert e.value.status == 409
    assert client.weights_version().version == fresh_weights


def test_push_needs_the_token(service, tiny_model):
    data = (tiny_model / "model.safetensors").read_bytes()
    for headers in ({}, {"Authorization": "Bearer wrong-token-123"}):
        r = httpx.post(f"{service}/v1/weights", params={"version": 10**6}, content=data, headers=headers)
        assert r.status_code == 401 and "Bearer" in r.json()["error"]


def test_oversized_and_malformed_pushes_are_refused(service, client, fresh_weights, tiny_model):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(
        f"{service}/v1/weights",
        params={"version": fresh_weights + 1},
        content=b"\0" * (MAX_WEIGHTS_BYTES + 1),
        headers=headers,
    )
    assert r.status_code == 413 and "FARM_MAX_WEIGHTS_BYTES" in r.json()["error"]
    data = bytearray((tiny_model / "model.safetensors").read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].replace(b'"data_offsets":[0,', b'"data_offsets":[4,', 1)  # first tensor four bytes short
    for body in (bytes(data[:8] + header + data[8 + n :]), b"\x02\0\0\0\0\0\0\0[]" + b"\0" * 16):
        with pytest.raises(FarmError) as e:
            client.push_weights(body, fresh_weights + 1)
        assert e.value.status == 422
    assert client.weights_version().version == fresh_weights


def test_push_every_replica_fails_to_stage_leaves_all_on_the_old_version(service, tiny_model, tmp_path):
    current = versions(service)["version"]
    before = tokens(rollout(service, greedy([[40, 41, 42]])))
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(perturbed(tiny_model, seed=1), bad / "model.safetensors")
    with open(
        bad / "model.safetensors", "ab"
    ) as f:  # headers stay valid (the ingress checks only those); safetensors refuses the file
        f.write(b"\0" * 64)
    r = push_path(service, bad, current + 1)
    assert r.status_code == 500 and f"every replica stays on version {current}" in r.json()["error"], r.text
    assert len(r.json()["detail"]) == 2  # both replicas said why
    now = versions(service)
    assert now["version"] == current and set(now["replicas"].values()) == {current} and len(now["replicas"]) == 2
    assert tokens(rollout(service, greedy([[40, 41, 42]]))) == before
    good = perturbed(tiny_model, seed=1)  # the same tensors, intact: version current + 1 is still free
    assert push(service, save(good), current + 1).status_code == 200
    assert set(versions(service)["replicas"].values()) == {current + 1}
    assert tokens(rollout(service, greedy([[40, 41, 42]]))) != before


def test_push_from_a_folder_changes_outputs_and_bumps_every_replica(service, tiny_model, tmp_path):
    current = versions(service)["version"]
    original = tmp_path / "original"
    original.mkdir()
    shutil.copy(tiny_model / "model.safetensors", original / "model.safetensors")
    changed = tmp_path / "changed"
    changed.mkdir()
    save_file(perturbed(tiny_model, seed=2), changed / "model.safetensors")
    body = greedy([[40, 41, 42], [43, 44, 45]])

    r = push_path(service, original, current + 1)
    assert (
        r.status_code == 200
        and r.json()["version"] == current + 1
        and r.json()["tensors"] == len(load_file(original / "model.safetensors"))
    )
    on_original = rollout(service, body)
    assert {s["weight_version"] for g in on_original.json()["groups"] for s in g["samples"]} == {current + 1}
    assert push_path(service, changed, current + 2).status_code == 200
    assert set(versions(service)["replicas"].values()) == {current + 2}
    assert tokens(rollout(service, body)) != tokens(on_original)
    assert push_path(service, original, current + 3).status_code == 200
    assert tokens(rollout(service, body)) == tokens(on_original)  # the folder's weights, exactly


def test_push_from_a_folder_without_safetensors_is_422_naming_path(service, tmp_path):
    current = versions(service)["version"]
    (tmp_path / "model.bin").write_bytes(b"not safetensors")
    for folder in (tmp_path, tmp_path / "missing"):
        r = push_path(service, folder, current + 1)
        assert r.status_code == 422 and [d["field"] for d in r.json()["detail"]] == ["path"], r.text
    assert versions(service)["version"] == current


def test_wrong_content_sha256_is_refused_and_the_right_one_accepted(service, tiny_model):
    current = versions(service)["version"]
    data = (tiny_model / "model.safetensors").read_bytes()
    r = push(service, data, current + 1, headers={"x-content-sha256": hashlib.sha256(b"other").hexdigest()})
    assert r.status_code == 422 and [d["field"] for d in r.json()["detail"]] == ["x-content-sha256"], r.text
    assert versions(service)["version"] == current
    r = push(service, data, current + 1, headers={"x-content-sha256": hashlib.sha256(data).hexdigest().upper()})
    assert r.status_code == 200 and versions(service)["version"] == current + 1


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_with_422_naming_the_tensor(service, fresh_weights, tiny_model, tmp_path, value):
    """NaN or inf in a pushed tensor would make every sampled rollout fail: both transports refuse it at staging,
    naming the tensor, and the old version keeps serving sampled rollouts."""
    name = "model.layers.0.self_attn.q_proj.weight"
    state = load_file(tiny_model / "model.safetensors")
    state[name] = state[name].clone()
    state[name][0, 0] = value
    folder = tmp_path / "poisoned"
    folder.mkdir()
    save_file(state, folder / "model.safetensors")
    for r, field in (
        (push(service, save(state), fresh_weights + 1), "body"),
        (push_path(service, folder, fresh_weights + 1), "path"),
    ):
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "weights refused; the old version keeps serving"
        (detail,) = r.json()["detail"]  # both replicas refused the same tensor: said once
        assert detail["field"] == field and f"tensor {name!r} holds" in detail["message"], detail
        assert ("1 NaN" if value != value else "1 inf") in detail["message"]
    now = versions(service)
    assert now["version"] == fresh_weights and set(now["replicas"].values()) == {fresh_weights}
    sampled = rollout(service, request(n=2))  # temperature 1: would fail on NaN weights
    assert sampled.status_code == 200, sampled.text
    assert {s["weight_version"] for g in sampled.json()["groups"] for s in g["samples"]} == {fresh_weights}


def test_the_trainers_push_by_path_writes_each_step_once_keeps_three_and_carries_its_probe(
    client, fresh_weights, tiny_model, tmp_path
):
    """trainer.push_dir: each step's weights are written to the folder once and loaded from there by every replica,
    with the step's probe scored on them; the folder keeps the newest 3 versions."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    probe = PushProbe.of_run(load().trainer, AutoTokenizer.from_pretrained(tiny_model), model)
    steps, pusher = tmp_path / "steps", PathPusher(client, tmp_path / "steps")
    torch.manual_seed(0)
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        version = push_weights(pusher, model, "finish", probe)
    assert version == fresh_weights + 4 and pusher.last["mode"] == "path"
    assert sorted(p.name for p in steps.iterdir()) == [f"v{version - 2}", f"v{version - 1}", f"v{version}"]
    written = load_file(steps / f"v{version}" / "model.safetensors")
    assert all(torch.equal(written[n], t) for n, t in canonical_state_dict(model).items())
    assert set(client.weights_version().replicas.values()) == {version}
    greedy_one = P.RolloutRequest.model_validate(request(n=1, temperature=0))
    assert {s.weight_version for g in client.rollouts(greedy_one).groups for s in g.samples} == {version}
    # negative control: the probe of other weights (the model folder's) is refused on every replica, so the probe
    # travelled with the path; the version stays
    other = compute_probe(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), probe.sequences)
    with pytest.raises(FarmError) as e:
        pusher.push(canonical_state_dict(model), version + 1, probe=other)
    assert probe_refused(e.value) and client.weights_version().version == version
