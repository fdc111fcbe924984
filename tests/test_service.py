"""The real Ray Serve app (two engine replicas, tiny Llama) over real HTTP on 127.0.0.1."""

import asyncio

import httpx
import pytest
import torch
from safetensors.torch import load_file, save
from transformers import AutoModelForCausalLM

from services import protocol as P
from services.client import FarmClient, FarmError
from tests.conftest import MAX_WEIGHTS_BYTES, TOKEN
from trainer.batch import make_batch
from trainer.forward import response_logprobs

pytestmark = pytest.mark.integration


def request(n=4, **params) -> dict:
    return {"prompts": [{"text": "Q: 12+3\nA:", "ground_truth": "15"}, {"text": "Q: 40-7\nA:", "ground_truth": "33"}, {"text": "hello"}],
            "n": n, "sampling_params": {"max_new_tokens": 8, "seed": 1, **params}, "reward": "gsm8k"}


def test_rollouts_return_groups_with_logprobs_that_match_the_model(client, fresh_weights, tiny_model):
    resp = client.rollouts(P.RolloutRequest.model_validate(request(n=4, temperature=0.8)))
    assert len(resp.groups) == 3
    for g in resp.groups:
        assert len(g.samples) == 4 and g.prompt_token_ids
        for s in g.samples:
            assert len(s.logprobs) == len(s.token_ids) >= 1 and s.weight_version == fresh_weights
            assert s.reward in (0.0, 1.0) and s.finish_reason in ("stop", "length")
        rewards = [s.reward for s in g.samples]
        assert g.reward_mean == pytest.approx(sum(rewards) / 4) and g.zero_variance == (len(set(rewards)) == 1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    batch = make_batch(resp.groups, pad_id=0)
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch)
    assert ((lp - batch.rollout_logprobs).abs() * batch.response_mask).max().item() < 1e-4


def test_weight_push_changes_outputs_and_increments_version(client, fresh_weights, tiny_model):
    greedy = P.RolloutRequest.model_validate(request(n=1, temperature=0))
    before = client.rollouts(greedy)
    state = load_file(tiny_model / "model.safetensors")
    torch.manual_seed(0)
    perturbed = {k: v + 0.5 * torch.randn_like(v) for k, v in state.items()}
    pushed = client.push_weights(save(perturbed), fresh_weights + 1)
    assert pushed.version == fresh_weights + 1 and pushed.tensors == len(state)
    version = client.weights_version()
    assert version.version == fresh_weights + 1 and set(version.replicas.values()) == {fresh_weights + 1} and len(version.replicas) == 2
    after = client.rollouts(greedy)
    assert all(s.weight_version == fresh_weights + 1 for g in after.groups for s in g.samples)
    assert [g.samples[0].token_ids for g in after.groups] != [g.samples[0].token_ids for g in before.groups]
    # every replica serves the new weights: many small requests spread over both give the same greedy answers
    for _ in range(4):
        assert [g.samples[0].token_ids for g in client.rollouts(greedy).groups] == [g.samples[0].token_ids for g in after.groups]


@pytest.mark.parametrize("breakage,words", [
    (lambda s: {**s, "lm_head.weight": torch.zeros(7, 7)}, "shape"),
    (lambda s: {**s, "lm_head.weight": s["lm_head.weight"].half()}, "dtype"),
    (lambda s: {k: v for k, v in s.items() if k != "lm_head.weight"}, "missing tensor"),
    (lambda s: {**s, "extra.weight": torch.zeros(2)}, "unexpected tensor"),
])
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


@pytest.mark.parametrize("patch,field", [
    ({"sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
    ({"sampling_params": {"top_p": 0.0}}, "sampling_params.top_p"),
    ({"sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ({"sampling_params": {"top_k": 0}}, "sampling_params"),
    ({"sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"n": P.MAX_N + 1}, "n"),
    ({"n": 0}, "n"),
    ({"prompts": []}, "prompts"),
    ({"prompts": [{"text": ""}]}, "prompts.0"),
    ({"prompts": [{"token_ids": []}]}, "prompts.0"),
    ({"prompts": [{"text": "a", "token_ids": [1]}]}, "prompts.0"),
])
def test_invalid_requests_get_422_naming_the_field(service, patch, field):
    body = request()
    for k, v in patch.items():
        body[k] = {**body[k], **v} if isinstance(v, dict) else v
    r = httpx.post(f"{service}/v1/rollouts", json=body)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert any(d["field"] == field for d in detail), detail
    assert all(d["message"] for d in detail)


def test_unknown_reward_lists_valid_names(service):
    r = httpx.post(f"{service}/v1/rollouts", json={**request(), "reward": "nope"})
    assert r.status_code == 422
    assert r.json()["detail"][0]["field"] == "reward" and "gsm8k" in r.json()["detail"][0]["message"]


def test_token_id_prompts(client):
    resp = client.rollouts(P.RolloutRequest(prompts=[P.Prompt(token_ids=[40, 41, 42])], n=2, sampling_params=P.SamplingParams(max_new_tokens=3)))
    assert resp.groups[0].prompt_token_ids == [40, 41, 42] and len(resp.groups[0].samples) == 2


def metric(service: str, name: str) -> float:
    """The value of one Prometheus sample, e.g. 'farm_samples_total{sampler="plain"}'."""
    for line in httpx.get(f"{service}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_health_metrics_and_docs(service, client, fresh_weights):
    h = client.health()
    assert h.status == "ok" and h.generated_token_id >= 0
    samples, groups = metric(service, 'farm_samples_total{sampler="plain"}'), metric(service, 'farm_groups_total{sampler="plain"}')
    client.rollouts(P.RolloutRequest.model_validate(request(n=2)))
    assert metric(service, 'farm_samples_total{sampler="plain"}') == samples + 6 and metric(service, 'farm_groups_total{sampler="plain"}') == groups + 3
    assert metric(service, "farm_weight_version") == fresh_weights
    assert metric(service, 'farm_generated_tokens_total{sampler="plain"}') > 0 and metric(service, "farm_weight_sync_bytes_total") > 0
    text = httpx.get(f"{service}/metrics").text
    replica_versions = [float(line.split()[1]) for line in text.splitlines() if line.startswith("farm_replica_weight_version{")]
    assert replica_versions == [fresh_weights, fresh_weights]  # both replicas, each labelled
    assert "farm_trajectory_staleness_versions_bucket" in text
    assert 'farm_request_seconds_bucket{le="0.01",path="/v1/rollouts"}' in httpx.get(f"{service}/metrics").text
    assert httpx.get(f"{service}/docs").status_code == 200
    spec = httpx.get(f"{service}/openapi.json").json()
    assert {"/v1/rollouts", "/v1/weights", "/v1/weights/version", "/healthz", "/metrics"} <= set(spec["paths"])


def test_client_retries_then_raises_on_a_dead_port():
    with FarmClient("http://127.0.0.1:9", retries=2, backoff_s=0.01) as c:
        calls, send = [], c.http.request
        c.http.request = lambda *a, **kw: calls.append(a) or send(*a, **kw)
        with pytest.raises(httpx.TransportError):
            c.weights_version()
    assert len(calls) == 3  # the first try and two retries


def test_oversized_and_malformed_pushes_are_refused(service, client, fresh_weights, tiny_model):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{service}/v1/weights", params={"version": fresh_weights + 1}, content=b"\0" * (MAX_WEIGHTS_BYTES + 1), headers=headers)
    assert r.status_code == 413 and "FARM_MAX_WEIGHTS_BYTES" in r.json()["error"]
    data = bytearray((tiny_model / "model.safetensors").read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].replace(b'"data_offsets":[0,', b'"data_offsets":[4,', 1)  # first tensor four bytes short
    for body in (bytes(data[:8] + header + data[8 + n:]), b"\x02\0\0\0\0\0\0\0[]" + b"\0" * 16):
        with pytest.raises(FarmError) as e:
            client.push_weights(body, fresh_weights + 1)
        assert e.value.status == 422
    assert client.weights_version().version == fresh_weights


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_json_bodies_get_413(service, chunked):
    from services.api.middleware import MAX_REQUEST_BYTES

    body = b'{"prompts": [{"text": "' + b"x" * MAX_REQUEST_BYTES + b'"}]}'
    content = iter([body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)]) if chunked else body  # no Content-Length when chunked
    r = httpx.post(f"{service}/v1/rollouts", content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "fewer prompts" in r.json()["error"]


def test_rewards_cannot_be_imported_by_a_request_and_seeds_are_bounded(service):
    r = httpx.post(f"{service}/v1/rollouts", json={**request(), "reward": "builtins:eval"})
    assert r.status_code == 422 and "FARM_PLUGINS" in r.json()["detail"][0]["message"]
    r = httpx.post(f"{service}/v1/rollouts", json=request(seed=2**64))
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "sampling_params.seed"


def test_unknown_paths_get_the_error_shape(service):
    r = httpx.get(f"{service}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]


def test_out_of_vocabulary_token_ids_get_422(service):
    r = httpx.post(f"{service}/v1/rollouts", json={"prompts": [{"text": "ok"}, {"token_ids": [1, 10**6]}], "n": 1})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "prompts.1.token_ids"


def test_restarted_replica_catches_up_before_serving(client, fresh_weights, tiny_model):
    """Kill an engine replica; Serve starts a new one, which loads the committed version before taking traffic."""
    import time

    import ray

    state = load_file(tiny_model / "model.safetensors")
    client.push_weights(save({k: v * 1.01 for k, v in state.items()}), fresh_weights + 1)
    old = client.weights_version().replicas
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::farm#engine")]
    assert len(names) == 2
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            now = client.weights_version().replicas
        except FarmError:
            now = {}
        if len(now) == 2 and set(now) != set(old):
            break
        assert time.monotonic() < deadline, f"no replacement replica: {now}"
        time.sleep(0.5)
    assert set(now.values()) == {fresh_weights + 1}  # the new replica serves the committed version, not version 0


async def test_request_id_replays_the_first_result_and_generates_nothing(service):
    body = {**request(n=3, temperature=1.0, seed=None), "request_id": "idem-1"}
    samples = metric(service, 'farm_samples_total{sampler="plain"}')
    async with httpx.AsyncClient(timeout=120) as http:
        first, *repeats = await asyncio.gather(*[http.post(f"{service}/v1/rollouts", json=body) for _ in range(3)])  # concurrent duplicates
        later = await http.post(f"{service}/v1/rollouts", json=body)
        other = await http.post(f"{service}/v1/rollouts", json={**body, "n": 2})
    assert first.status_code == 200 and all(r.json() == first.json() for r in [*repeats, later])
    assert metric(service, 'farm_samples_total{sampler="plain"}') == samples + 9  # generated and counted once (3 prompts x 3)
    assert metric(service, "farm_idempotent_replays_total") >= 3
    assert other.status_code == 409 and "different request" in other.json()["error"]


def test_client_sends_a_request_id_and_reuses_it_on_retry(service):
    with FarmClient(service, TOKEN, retries=2, backoff_s=0.01) as c:
        sent, send = [], c.http.request

        def flaky(*a, **kw):  # the first attempt of each call loses its connection
            sent.append(kw.get("json"))
            if len(sent) % 2 == 1:
                raise httpx.ConnectError("connection dropped")
            return send(*a, **kw)

        c.http.request = flaky
        c.rollouts(P.RolloutRequest.model_validate(request(n=1)))
        c.rollouts(P.RolloutRequest.model_validate(request(n=1)))
    ids = [b["request_id"] for b in sent]
    assert len(ids) == 4 and ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2]
