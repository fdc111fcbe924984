"""POST /v1/rollouts: groups and logprobs that match the model, request ids, and 422s naming the field."""

import asyncio

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from rollout_farm.trainer.algorithms.forward import response_logprobs
from rollout_farm.trainer.batch import make_batch
from tests.conftest import TOKEN
from tests.service.helpers import metric, request


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
        tempered, _ = response_logprobs(model, batch, batch.temperatures)
    assert ((lp - batch.rollout_logprobs).abs() * batch.response_mask).max().item() < 1e-4
    # the trainer's policy (logits / T) is the distribution the service sampled from (no top-p/k here)
    assert torch.all(batch.temperatures == 0.8) and torch.all(batch.sampling_known == 1)
    assert ((tempered - batch.sampling_logprobs).abs() * batch.response_mask).max().item() < 1e-4
    assert ((tempered - lp).abs() * batch.response_mask).max().item() > 1e-2


@pytest.mark.parametrize(
    "patch,field",
    [
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
    ],
)
def test_invalid_requests_get_422_naming_the_field(service, patch, field):
    body = request()
    for k, v in patch.items():
        body[k] = {**body[k], **v} if isinstance(v, dict) else v
    r = httpx.post(f"{service}/v1/rollouts", json=body)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert any(d["field"] == field for d in detail), detail
    assert all(d["message"] for d in detail)


@pytest.mark.parametrize(
    "patch,field",
    [
        ({"sampling": {"max_new_tokens": 2}}, "sampling"),  # sampling_params misspelt: not sampled with defaults
        ({"sampling_params": {"max_tokens": 2}}, "sampling_params.max_tokens"),  # OpenAI's name, not ours
        ({"prompts": [{"text": "a", "answer": "1"}]}, "prompts.0.answer"),
    ],
)
def test_unknown_fields_get_422_naming_them(service, patch, field):
    body = request()
    for k, v in patch.items():
        body[k] = {**body.get(k, {}), **v} if isinstance(v, dict) else v
    r = httpx.post(f"{service}/v1/rollouts", json=body)
    assert r.status_code == 422
    (d,) = [d for d in r.json()["detail"] if d["field"] == field]
    assert "remove it" in d["message"]


def test_unknown_reward_lists_valid_names(service):
    r = httpx.post(f"{service}/v1/rollouts", json={**request(), "reward": "nope"})
    assert r.status_code == 422
    assert r.json()["detail"][0]["field"] == "reward" and "gsm8k" in r.json()["detail"][0]["message"]


def test_token_id_prompts(client):
    resp = client.rollouts(
        P.RolloutRequest(
            prompts=[P.Prompt(token_ids=[40, 41, 42])], n=2, sampling_params=P.SamplingParams(max_new_tokens=3)
        )
    )
    assert resp.groups[0].prompt_token_ids == [40, 41, 42] and len(resp.groups[0].samples) == 2


def test_rewards_cannot_be_imported_by_a_request_and_seeds_are_bounded(service):
    r = httpx.post(f"{service}/v1/rollouts", json={**request(), "reward": "builtins:eval"})
    assert r.status_code == 422 and "FARM_PLUGINS" in r.json()["detail"][0]["message"]
    r = httpx.post(f"{service}/v1/rollouts", json=request(seed=2**64))
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "sampling_params.seed"


def test_out_of_vocabulary_token_ids_get_422(service):
    r = httpx.post(f"{service}/v1/rollouts", json={"prompts": [{"text": "ok"}, {"token_ids": [1, 10**6]}], "n": 1})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "prompts.1.token_ids"


async def test_request_id_replays_the_first_result_and_generates_nothing(service):
    """Three duplicates of a request_id get the first result, counted as three replays and generated once; the
    counters are read before and their increase asserted (exported at 0 from the start), so it holds alone and in
    any order."""
    body = {**request(n=3, temperature=1.0, seed=None), "request_id": "idem-1"}
    samples = metric(service, "farm_samples_total", sampler="plain")
    replays = metric(service, "farm_idempotent_replays_total")
    async with httpx.AsyncClient(timeout=120) as http:
        first, *repeats = await asyncio.gather(
            *[http.post(f"{service}/v1/rollouts", json=body) for _ in range(3)]
        )  # concurrent duplicates
        later = await http.post(f"{service}/v1/rollouts", json=body)
        other = await http.post(f"{service}/v1/rollouts", json={**body, "n": 2})
    assert first.status_code == 200 and all(r.json() == first.json() for r in [*repeats, later])
    assert (
        metric(service, "farm_samples_total", sampler="plain") == samples + 9
    )  # generated and counted once (3 prompts x 3)
    assert metric(service, "farm_idempotent_replays_total") == replays + 3  # the two concurrent ones and the later
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
