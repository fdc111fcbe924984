"""The unmodified `tinker` SDK (0.38.0) against the real service (two engine replicas, two ingress replicas, real
Redis, real HTTP): a tenant's key samples from the adapter the tenant pushed, with the tokens and logprobs /v1/rollouts
gives for the same seed and adapter; compute_logprobs is a plain forward pass of the merged model; another tenant's
key gets nothing of it; a training call is a clear error (docs/tenants.md, "Tinker")."""

from __future__ import annotations

import itertools
import time

import httpx
import pytest
import tinker
import torch
from tinker import types

from rollout_farm.services.client.peft_files import upload_body
from tests.adapters import peft_adapter
from tests.conftest import TOKEN

ADMIN = {"Authorization": f"Bearer {TOKEN}"}
TENANTS = ("tinker-a", "tinker-b")
NAMES = itertools.count(1)


@pytest.fixture(scope="module")
def folder(tiny_model, tmp_path_factory):
    return peft_adapter(tiny_model, tmp_path_factory.mktemp("tinker-adapters") / "a", seed=11)


@pytest.fixture(scope="module")
def prompt(tiny_model) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model).encode("12 + 30 =")


@pytest.fixture
def http(service, fresh_weights):
    """The service on the model folder's weights; afterwards every adapter retired (so the other tests' base pushes
    are not refused) and this module's tenants revoked."""
    with httpx.Client(base_url=service, timeout=120) as c:
        yield c
        for a in c.get("/v1/adapters", headers=ADMIN).json()["adapters"]:
            c.delete(f"/v1/adapters/{a['name']}", headers=ADMIN)
        for t in TENANTS:
            c.delete(f"/v1/tenants/{t}", headers=ADMIN)


@pytest.fixture
def keys(http) -> dict[str, str]:
    """A token per tenant: each a valid Tinker key as it is ("tml-...")."""
    made = {t: http.post(f"/v1/tenants/{t}", headers=ADMIN).json()["token"] for t in TENANTS}
    assert all(k.startswith("tml-") for k in made.values())
    return made


@pytest.fixture
def alpha(http, keys, folder) -> str:
    """tinker-a pushes a new adapter (versions are never reused, even retired ones), v1, with its own token."""
    name = f"tk-alpha-{next(NAMES)}"
    pushed = http.post(
        f"/v1/adapters/{name}",
        params={"version": 1},
        content=upload_body(folder),
        headers={"Authorization": f"Bearer {keys['tinker-a']}"},
    )
    assert pushed.status_code == 200, pushed.text
    return name


def rollout(http, key: str, body: dict) -> dict:
    """POST /v1/rollouts with a tenant's bearer token; a 429 (the test service's small queues) is retried."""
    for _ in range(100):
        answer = http.post("/v1/rollouts", json=body, headers={"Authorization": f"Bearer {key}"})
        if answer.status_code != 429:
            assert answer.status_code == 200, answer.text
            return answer.json()
        time.sleep(float(answer.headers.get("retry-after", 1)))
    raise AssertionError("queues full for 100 tries")


def test_a_tenant_samples_its_adapter_as_v1_rollouts_does(service, http, keys, alpha, prompt):
    params = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 7}
    expected = rollout(
        http,
        keys["tinker-a"],
        {"prompts": [{"token_ids": prompt}], "n": 2, "sampling_params": params, "adapter": {"name": alpha}},
    )["groups"][0]["samples"]
    with tinker.ServiceClient(base_url=service, api_key=keys["tinker-a"]) as sc:
        for path in (f"tinker://{alpha}", f"tinker://{alpha}@v1"):
            sampler = sc.create_sampling_client(model_path=path).result()
            got = sampler.sample(
                prompt=types.ModelInput.from_ints(prompt),
                num_samples=2,
                sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, top_k=20, seed=7),
            ).result()
            assert [s.tokens for s in got.sequences] == [s["token_ids"] for s in expected]
            for s, e in zip(got.sequences, expected):
                assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(e["logprobs"]), atol=1e-6)
                assert s.stop_reason == e["finish_reason"]
            assert len({s.sequence_id for s in got.sequences}) == 2
        # the adapter changes what is sampled: the base (base_model alone) draws other tokens
        base = sc.create_sampling_client(base_model=sampler.get_base_model()).result()
        drawn = base.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=7)).result()
        assert [s.tokens for s in drawn.sequences] != [s["token_ids"] for s in expected]


def test_compute_logprobs_is_the_merged_models_forward_pass(service, keys, alpha, prompt, tiny_model, folder):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with tinker.ServiceClient(base_url=service, api_key=keys["tinker-a"]) as sc:
        sampler = sc.create_sampling_client(model_path=f"tinker://{alpha}").result()
        got = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folder).merge_and_unload()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logp = torch.log_softmax(merged(ids).logits[0, :-1].float(), -1)
    want = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert got[0] is None and len(got) == len(prompt)
    assert torch.allclose(torch.tensor(got[1:]), want, atol=1e-4)


def test_another_tenants_key_gets_nothing_of_the_adapter(service, http, keys, alpha, prompt):
    with tinker.ServiceClient(base_url=service, api_key=keys["tinker-b"]) as sc:
        with pytest.raises(tinker.NotFoundError, match="unknown"):
            sc.create_sampling_client(model_path=f"tinker://{alpha}").result()
    # nor through tinker-a's sampling session and futures, named outright
    a, b = ({"X-API-Key": keys[t]} for t in TENANTS)
    session = http.post("/api/v1/create_session", json={}, headers=a).json()["session_id"]
    made = {"session_id": session, "sampling_session_seq_id": 0, "model_path": f"tinker://{alpha}"}
    sampler = http.post("/api/v1/create_sampling_session", json=made, headers=a).json()["sampling_session_id"]
    sample = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": 2},
    }
    assert http.post("/api/v1/asample", json=sample, headers=b).status_code == 404
    assert http.get(f"/api/v1/samplers/{sampler}", headers=b).status_code == 404
    future = http.post("/api/v1/asample", json=sample, headers=a).json()["request_id"]
    assert http.post("/api/v1/asample", json=sample, headers=a).json()["request_id"] == future  # a resubmission
    assert http.post("/api/v1/retrieve_future", json={"request_id": future}, headers=b).status_code == 404
    mine = http.post("/api/v1/retrieve_future", json={"request_id": future}, headers=a)
    assert mine.status_code == 200 and mine.headers["content-type"] == "application/x-protobuf"
    gone = http.post("/api/v1/retrieve_future", json={"request_id": f"{sampler}:99"}, headers=a)
    assert gone.status_code == 410  # unknown or expired: the SDK submits the sample again
    refused = http.post("/api/v1/asample", json={**sample, "seq_id": 1, "topk_prompt_logprobs": 5}, headers=a)
    assert refused.status_code == 422 and refused.json()["detail"][0]["field"] == "topk_prompt_logprobs"


def test_training_calls_are_a_clear_error_and_the_admin_key_works(service):
    with tinker.ServiceClient(base_url=service, api_key=f"tml-{TOKEN}") as sc:
        with pytest.raises(tinker.NotFoundError, match="not served.*sampling calls only"):
            sc.create_lora_training_client(base_model="tiny-llama", rank=4).result()
        sampler = sc.create_sampling_client(base_model="tiny-llama").result()
        lps = sampler.compute_logprobs(types.ModelInput.from_ints([1, 2, 3])).result()
        assert lps[0] is None and all(x < 0 for x in lps[1:])
    with pytest.raises(tinker.AuthenticationError, match="X-API-Key"):
        tinker.ServiceClient(base_url=service, api_key="tml-wrong").create_sampling_client(base_model="x").result()
