"""A base weight push's probe (rollout_farm/services/weights/probe.py): every replica scores it on the staged weights
before the commit; a wrong one refuses the push everywhere, and the old version keeps serving.

The negative control is the issue's failure: logprobs that are not the pushed weights' (here, the served model's: a
pusher whose engine never applied the new weights would see those)."""

import json

import pytest
import torch
from safetensors.torch import save, save_file
from transformers import AutoModelForCausalLM

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmError
from rollout_farm.services.weights.probe import PATH_FILE
from rollout_farm.services.weights.pusher import WeightPusher, compute_probe
from tests.service.helpers import perturbed, push, push_path, request

SEQUENCES = [[1, 5, 9, 2, 7, 30, 4, 11], [3, 3, 8, 1, 60]]
GREEDY = P.RolloutRequest.model_validate(request(n=1, temperature=0))


def probe_of(tiny_model, state: dict | None, tolerance: float = 1e-4) -> dict:
    """The probe a pusher of `state` computes (None: the model folder's own weights)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state, strict=False)
    return compute_probe(model, SEQUENCES, tolerance)


def with_probe(state: dict, probe: dict) -> bytes:
    return save(state, metadata={"probe": json.dumps(probe)})


def assert_refused_and_old_served(client, r_or_error, served: int, before: list) -> None:
    status, body = (r_or_error.status_code, r_or_error.json()) if hasattr(r_or_error, "json") else r_or_error
    assert status == 422, body
    for detail in body["detail"]:  # one per replica that refused: each names itself, the sequence and the token
        message = detail["message"]
        assert detail["field"] == "probe" and "replica" in message and "sequence" in message and "token" in message
    v = client.weights_version()
    assert v.version == served and set(v.replicas.values()) == {served} and len(v.replicas) == 2  # refused everywhere
    after = client.rollouts(GREEDY)
    assert [g.samples[0].token_ids for g in after.groups] == before
    assert all(s.weight_version == served for g in after.groups for s in g.samples)


def test_a_base_push_probe_passes_when_right_and_refuses_the_push_everywhere_when_wrong(
    client, service, fresh_weights, tiny_model
):
    new = perturbed(tiny_model, seed=11)
    good, stale = probe_of(tiny_model, new), probe_of(tiny_model, None)
    # negative control: the served weights' logprobs, as from an engine that never applied the push
    before = [g.samples[0].token_ids for g in client.rollouts(GREEDY).groups]
    r = push(service, with_probe(new, stale), fresh_weights + 1)
    assert_refused_and_old_served(client, r, fresh_weights, before)
    # the same weights with their own probe pass; the refused push used no version up
    assert push(service, with_probe(new, good), fresh_weights + 1).status_code == 200
    assert client.weights_version().version == fresh_weights + 1
    assert [g.samples[0].token_ids for g in client.rollouts(GREEDY).groups] != before


def test_the_pushers_probe_rides_bucketed_and_delta_pushes(client, fresh_weights, tiny_model):
    pusher = WeightPusher(client, "delta", bucket_bytes=1 << 16)
    first, second = perturbed(tiny_model, seed=21), perturbed(tiny_model, seed=21)
    second["model.norm.weight"] = second["model.norm.weight"] + 0.25  # one tensor changed: a delta push
    pushed = pusher.push(first, fresh_weights + 1, probe=probe_of(tiny_model, first))
    assert pushed.version == fresh_weights + 1
    before = [g.samples[0].token_ids for g in client.rollouts(GREEDY).groups]
    with pytest.raises(FarmError) as e:  # a probe of the first weights on the second: refused
        pusher.push(second, fresh_weights + 2, probe=probe_of(tiny_model, first))
    assert_refused_and_old_served(client, (e.value.status, e.value.body), fresh_weights + 1, before)
    pushed = pusher.push(second, fresh_weights + 2, probe=probe_of(tiny_model, second))
    assert pushed.version == fresh_weights + 2 and pushed.base == fresh_weights + 1  # a delta push, probed


def test_a_push_by_path_carries_its_probe_in_its_body_or_folder(client, service, fresh_weights, tiny_model, tmp_path):
    new = perturbed(tiny_model, seed=31)
    folder = tmp_path / "step-1"
    folder.mkdir()
    save_file(new, folder / "model.safetensors")
    stale, good = probe_of(tiny_model, None), probe_of(tiny_model, new)
    before = [g.samples[0].token_ids for g in client.rollouts(GREEDY).groups]
    r = push_path(service, folder, fresh_weights + 1, probe=stale)  # in the body, as an adapter push by path
    assert_refused_and_old_served(client, r, fresh_weights, before)
    (folder / PATH_FILE).write_text(json.dumps(stale))  # in the folder
    assert_refused_and_old_served(client, push_path(service, folder, fresh_weights + 1), fresh_weights, before)
    r = push_path(service, folder, fresh_weights + 1, probe=good)  # both: which one would be meant?
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "probe", r.text
    (folder / PATH_FILE).unlink()
    assert push_path(service, folder, fresh_weights + 1, probe=good).status_code == 200


def test_a_malformed_probe_is_refused_before_any_replica_stages(client, service, fresh_weights, tiny_model):
    new = perturbed(tiny_model, seed=41)
    bad = {"sequences": [[1, 2]], "logprobs": []}
    r = push(service, with_probe(new, bad), fresh_weights + 1)
    assert r.status_code == 422 and r.json()["detail"][0]["field"].startswith("probe"), r.text
    out_of_vocabulary = {"sequences": [[1, 10**6]], "logprobs": [[None, -1.0]]}
    r = push(service, with_probe(new, out_of_vocabulary), fresh_weights + 1)
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "probe.sequences.0", r.text
    assert client.weights_version().version == fresh_weights
