"""LoRA adapters on the real service (two engine replicas, real Redis, real HTTP): pushes, immutable versions, the
policy digest on every sample (equal to the one a client computes from what it pushed), batched rows of several
adapters, the resident window, refusals that leave nothing behind, the base push guard, and tenants' isolation."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save

from rollout_farm.services.adapters.digest import adapter_digest, base_digest, tensor_checksums
from rollout_farm.services.adapters.peft_format import read_folder
from tests.adapters import ADMIN, push, rollout


def expected_digest(tiny_model, folder) -> str:
    """What a trainer computes from what it pushed: the base's tensors and the adapter's, never a version number."""
    base = base_digest(*tensor_checksums(load_file(tiny_model / "model.safetensors")))
    config, tensors_file = read_folder(folder)
    return adapter_digest(base, config.canonical(), *tensor_checksums(load_file(tensors_file)))


def tokens(answer) -> list:
    return [[s["token_ids"] for s in g["samples"]] for g in answer.json()["groups"]]


def test_samples_carry_the_digest_the_client_computes_and_match_the_merged_model(http, folders, tiny_model):
    pushed = push(http, "alpha", 1, folders[1])
    assert pushed.status_code == 200, pushed.text
    assert pushed.json()["digest"] == expected_digest(tiny_model, folders[1])
    on = rollout(http, {"name": "alpha", "version": 1})
    assert on.status_code == 200, on.text
    for g in on.json()["groups"]:
        for s in g["samples"]:
            assert s["policy"]["adapter"] == "alpha" and s["policy"]["adapter_version"] == 1
            assert s["policy"]["digest"] == pushed.json()["digest"]
    base = rollout(http)
    assert all(
        s["policy"]["adapter"] is None and s["policy"]["digest"] for g in base.json()["groups"] for s in g["samples"]
    )
    assert tokens(on) != tokens(base)  # the adapter changes what is sampled
    # the adapter's logprobs are those of the base with the adapter merged in, by a plain forward pass
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folders[1]).merge_and_unload()
    g = on.json()["groups"][0]
    s = g["samples"][0]
    ids = torch.tensor([g["prompt_token_ids"] + s["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(merged(ids).logits[0, :-1].float(), -1)
    n = len(g["prompt_token_ids"])
    want = logp[n - 1 :].gather(-1, ids[0, n:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(s["logprobs"]), want, atol=1e-4)


def test_rows_of_several_adapters_share_batches_and_each_gets_its_own_policy(http, folders):
    for name, seed in (("beta1", 1), ("beta2", 2)):
        assert push(http, name, 1, folders[seed]).status_code == 200
    refs = [{"name": "beta1", "version": 1}, {"name": "beta2", "version": 1}, None]
    alone = [tokens(rollout(http, ref)) for ref in refs]
    assert alone[0] != alone[1] != alone[2]
    # at once (within the service's queue limits): each replica batches rows of all three policies together
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda ref: rollout(http, ref), refs))
    for i, answer in enumerate(together):
        assert answer.status_code == 200 and tokens(answer) == alone[i]


def test_versions_are_immutable_and_only_the_resident_window_is_served(http, folders, tiny_model):
    assert push(http, "gamma", 1, folders[1]).status_code == 200
    again = push(http, "gamma", 1, folders[1])
    assert again.status_code == 200 and again.json()["again"] is True
    other = push(http, "gamma", 1, folders[2])
    assert other.status_code == 409 and "never reused" in other.json()["error"]
    for v, seed in ((2, 2), (3, 3), (4, 4)):
        assert push(http, "gamma", v, folders[seed]).status_code == 200
    lower = push(http, "gamma", 3, folders[5])
    assert lower.status_code == 409  # other bytes under a used version
    gone = rollout(http, {"name": "gamma", "version": 1})
    assert gone.status_code == 409 and "v2..v4" in gone.json()["error"] and "evicted" in gone.json()["error"]
    newest = rollout(http, {"name": "gamma", "min_version": 3})
    assert newest.status_code == 200
    assert {s["policy"]["adapter_version"] for g in newest.json()["groups"] for s in g["samples"]} == {4}
    assert rollout(http, {"name": "gamma", "min_version": 5}).status_code == 409
    served = push(http, tiny_model.name, 1, folders[1])  # the base's name: OpenAI clients would get the adapter
    assert served.status_code == 422 and served.json()["detail"][0]["field"] == "name"
    unknown = rollout(http, {"name": "nobody", "version": 1})
    assert unknown.status_code == 404 and "nobody" in unknown.json()["error"]
    info = http.get("/v1/adapters/gamma").json()
    assert [v["state"] for v in info["versions"]] == ["evicted", "resident", "resident", "resident"]
    assert all(sorted(vs) == [2, 3, 4] for vs in info["resident"].values()) and len(info["resident"]) == 2


def _broken(folder, tmp, config=None, tensors=None):
    """A copy of a peft folder with its config or tensors changed."""
    out = tmp / "broken"
    out.mkdir(exist_ok=True)
    raw = json.loads((folder / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(config(raw) if config else json.dumps(raw))
    t = load_file(folder / "adapter_model.safetensors")
    (out / "adapter_model.safetensors").write_bytes(save(tensors(t) if tensors else t))
    return out


@pytest.mark.parametrize(
    "config, tensors, field, words",
    [
        (lambda c: json.dumps({**c, "r": 8}), None, "adapter_model", "shape"),
        (lambda c: "{not json", None, "adapter_config", "not JSON"),
        (lambda c: json.dumps({**c, "use_dora": True}), None, "adapter_config.use_dora", "DoRA"),
        (lambda c: json.dumps({**c, "base_model_name_or_path": "/m/other-model"}), None, "base_model", "made for"),
        (
            None,
            lambda t: {k.replace("q_proj", "nope_proj"): v for k, v in t.items()},
            "adapter_model",
            "not in the served model",
        ),
        (None, lambda t: {k: v * float("nan") for k, v in t.items()}, "adapter_model", "NaN"),
    ],
)
def test_bad_adapters_are_refused_naming_the_field_and_nothing_stays(
    http, folders, tmp_path, config, tensors, field, words
):
    name = "bad-" + re.sub("[^a-z]+", "-", words.lower())
    bad = push(http, name, 1, _broken(folders[1], tmp_path, config, tensors))
    assert bad.status_code == 422, bad.text
    body = bad.json()
    assert any(field in d["field"] for d in body["detail"]) and words in json.dumps(body)
    info = http.get(f"/v1/adapters/{name}", headers=ADMIN)
    assert info.status_code == 404 or not info.json()["versions"]
    assert all(not vs for vs in (info.json().get("resident") or {}).values()) if info.status_code == 200 else True
    assert push(http, name, 1, folders[1]).status_code == 200  # the version was not used up


def test_a_base_push_is_refused_while_adapters_are_resident_unless_forced(http, folders, tiny_model):
    assert push(http, "eps", 1, folders[1]).status_code == 200
    version = http.get("/v1/weights/version").json()["version"]
    weights = (tiny_model / "model.safetensors").read_bytes()
    refused = http.post("/v1/weights", params={"version": version + 1}, content=weights, headers=ADMIN)
    assert refused.status_code == 409 and refused.json()["detail"][0]["field"] == "force"
    assert "eps@v1" in refused.json()["error"]
    forced = http.post("/v1/weights", params={"version": version + 1, "force": True}, content=weights, headers=ADMIN)
    assert forced.status_code == 200, forced.text
    assert rollout(http, {"name": "eps", "version": 1}).status_code == 409  # retired with the old base


def test_a_forced_base_push_under_a_running_adapter_rollout_delivers_no_sample_of_it(http, folders, tiny_model):
    """An adapter sample never spans a base commit: a forced base push retires the adapter, but a rollout running on
    it keeps it pinned; the commit ("partial") lands under its tokens, so the rollout is a 409, not samples drawn by
    the adapter on a base it was not pushed on."""
    from tests.service.helpers import any_busy, in_thread, perturbed, wait_until

    assert push(http, "eta", 1, folders[1]).status_code == 200
    service = str(http.base_url).rstrip("/")
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    version = http.get("/v1/weights/version").json()["version"]
    weights = save(perturbed(tiny_model, seed=4, scale=0.1))
    long = {"temperature": 0, "max_new_tokens": 4096, "ignore_eos": True}
    body = {"prompts": [{"token_ids": [40, 41, 42]}], "n": 2, "adapter": {"name": "eta", "version": 1}}
    t, out = in_thread(lambda: http.post("/v1/rollouts", json={**body, "sampling_params": long}))
    wait_until(lambda: any_busy(service), "a replica busy with the adapter rollout")
    params = {"version": version + 1, "force": True, "policy": "partial"}
    forced = http.post("/v1/weights", params=params, content=weights, headers=ADMIN)
    assert forced.status_code == 200, forced.text
    t.join(300)
    assert out and not isinstance(out[0], Exception), out
    answer = out[0]
    assert answer.status_code == 409, answer.text[:500]
    assert "base weights changed under adapter eta@v1" in answer.json()["error"]
    assert answer.json()["detail"][0]["field"] == "adapter.version"


def test_tenants_see_and_use_only_their_own_adapters(http, folders):
    tokens_ = {}
    for t in ("team-a", "team-b"):
        made = http.post(f"/v1/tenants/{t}", headers=ADMIN)
        assert made.status_code == 200
        tokens_[t] = {"Authorization": f"Bearer {made.json()['token']}"}
    assert push(http, "mine", 1, folders[1], headers=tokens_["team-a"]).status_code == 200
    assert http.get("/v1/adapters/mine", headers=tokens_["team-a"]).json()["owner"] == "team-a"
    # another tenant learns nothing about it, and cannot use or change it
    assert http.get("/v1/adapters/mine", headers=tokens_["team-b"]).status_code == 404
    assert "mine" not in json.dumps(http.get("/v1/adapters", headers=tokens_["team-b"]).json())
    assert rollout(http, {"name": "mine", "version": 1}, headers=tokens_["team-b"]).status_code == 404
    assert push(http, "mine", 2, folders[2], headers=tokens_["team-b"]).status_code == 404
    assert http.delete("/v1/adapters/mine", headers=tokens_["team-b"]).status_code == 404
    assert rollout(http, {"name": "mine", "version": 1}).status_code == 404  # nobody (no token) neither
    # its owner and the admin can
    assert rollout(http, {"name": "mine", "version": 1}, headers=tokens_["team-a"]).status_code == 200
    assert http.get("/v1/adapters/mine", headers=ADMIN).status_code == 200
    # a tenant cannot manage tenants or push base weights
    assert http.get("/v1/tenants", headers=tokens_["team-a"]).status_code == 401
    assert http.post("/v1/weights", params={"version": 99}, content=b"x", headers=tokens_["team-a"]).status_code == 401
    # revoked: its token stops working at once
    assert http.delete("/v1/tenants/team-a", headers=ADMIN).status_code == 200
    assert push(http, "mine", 2, folders[2], headers=tokens_["team-a"]).status_code == 401
    # on an open route a token that is nobody's is no one's: it sees what anyone sees (an OpenAI client's placeholder
    # key must keep working), never the revoked tenant's adapters
    assert "mine" not in json.dumps(http.get("/v1/adapters", headers=tokens_["team-a"]).json())
    http.delete("/v1/tenants/team-b", headers=ADMIN)


def test_a_probe_proves_the_engine_and_a_wrong_one_refuses_the_push_everywhere(
    http, folders, tiny_model, service_settings
):
    import redis
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rollout_farm.services.serving import server
    from rollout_farm.services.state.redis_client import prefix
    from rollout_farm.services.weights.pusher import compute_probe as compute

    sequences = [[1, 5, 9, 2, 7], [3, 3, 8, 1]]
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folders[2])
    good = compute(with_adapter, sequences, tolerance=1e-4)
    assert push(http, "probed", 1, folders[2], probe=good).status_code == 200
    # negative control: the logprobs of the base model, as from a pusher whose engine never applied the adapter
    with with_adapter.disable_adapter():
        stale = compute(with_adapter, sequences, tolerance=1e-4)
    bad = push(http, "probed", 2, folders[2], probe=stale)
    assert bad.status_code == 422, bad.text
    detail = bad.json()["detail"][0]
    assert detail["field"] == "probe" and "replica" in detail["message"] and "differs" in detail["message"]
    assert [v["version"] for v in http.get("/v1/adapters/probed").json()["versions"]] == [1]  # nothing recorded
    info = http.get("/v1/adapters/probed").json()
    assert all(vs == [1] for vs in info["resident"].values())  # nothing of v2 stayed on any replica
    embedded = next(e for e in server.EMBEDDED if str(e.folder) == service_settings.state_dir)
    bodies = f"{prefix(service_settings.app_name)}:adapter:probed:v*:bytes"  # stored while the replicas staged v2
    assert sorted(redis.Redis.from_url(embedded.url).keys(bodies)) == [bodies.replace("*", "1").encode()]
    malformed = push(http, "probed", 2, folders[2], probe={"sequences": [[1, 2]], "logprobs": []})
    assert malformed.status_code == 422 and malformed.json()["detail"][0]["field"].startswith("probe")
