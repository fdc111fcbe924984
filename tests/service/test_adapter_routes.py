"""An adapter named on every route that samples, with the real clients: the openai SDK (`model="name@vN"`), SGLang's
/generate (`lora_path`), sessions and episodes (`adapter`), and GET /v1/models; tenants' sessions and quotas (429
naming the tenant) on the real service and Redis."""

from __future__ import annotations

import itertools
import threading
import time

import openai
import pytest

from tests.adapters import ADMIN, push, rollout
from tests.metrics_text import samples

GREEDY = {"temperature": 0, "max_new_tokens": 6}


NAMES = itertools.count()


@pytest.fixture
def adapter(http, folders):
    """`routes-<i>@v1` pushed by the admin (a name per test: http retires every adapter after each, and a retired
    version is never reused), and its greedy sample of "1 + 2 =" through /v1/rollouts."""
    name = f"routes-{next(NAMES)}"
    assert push(http, name, 1, folders[3]).status_code == 200
    answer = rollout(http, {"name": name, "version": 1}, prompts=[{"text": "1 + 2 ="}], n=1)
    assert answer.status_code == 200, answer.text
    base = rollout(http, prompts=[{"text": "1 + 2 ="}], n=1).json()["groups"][0]
    group = answer.json()["groups"][0]
    assert group["samples"][0]["token_ids"] != base["samples"][0]["token_ids"]  # the adapter makes a difference
    return name, group


def test_the_openai_sdk_names_an_adapter_as_its_model(service, http, adapter):
    name, adapter = adapter
    client = openai.OpenAI(base_url=f"{service}/v1", api_key="unused", max_retries=3, timeout=120)
    out = client.completions.create(model=f"{name}@v1", prompt="1 + 2 =", max_tokens=6, temperature=0)
    assert out.model == f"{name}@v1" and out.choices[0].text == adapter["samples"][0]["text"]
    newest = client.completions.create(model=name, prompt="1 + 2 =", max_tokens=6, temperature=0)
    assert newest.model == f"{name}@v1" and newest.choices[0].text == out.choices[0].text
    base = client.completions.create(model="anything-else", prompt="1 + 2 =", max_tokens=6, temperature=0)
    assert base.model != f"{name}@v1"  # any other name is the base model, as before adapters
    with pytest.raises(openai.ConflictError) as e:  # a version outside the resident window
        client.completions.create(model=f"{name}@v7", prompt="1 + 2 =", max_tokens=6)
    assert "v1..v1" in e.value.response.json()["error"]
    with pytest.raises(openai.NotFoundError) as e:  # no such adapter
        client.completions.create(model="nobody@v1", prompt="1 + 2 =", max_tokens=6)
    assert e.value.response.json()["detail"][0]["field"] == "model"
    assert f"{name}@v1" in [m.id for m in client.models.list().data]
    scored = client.completions.create(model=f"{name}@v1", prompt="1 + 2 =", max_tokens=6, temperature=0, logprobs=1)
    lps = scored.choices[0].logprobs.token_logprobs  # scored again under the adapter: the sampled logprobs
    assert max(abs(a - b) for a, b in zip(lps, adapter["samples"][0]["logprobs"])) < 1e-4


def test_sglang_generate_takes_lora_path(http, adapter):
    name, adapter = adapter
    body = {"input_ids": adapter["prompt_token_ids"], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    out = http.post(
        "/generate", json={**body, "lora_path": f"{name}@v1", "return_logprob": True, "logprob_start_len": 0}
    )
    assert out.status_code == 200, out.text
    assert out.json()["output_ids"] == adapter["samples"][0]["token_ids"]
    unknown = http.post("/generate", json={**body, "lora_path": "nobody"})
    assert unknown.status_code == 404 and unknown.json()["detail"][0]["field"] == "lora_path"


def test_a_session_samples_every_turn_from_its_adapter(http, adapter):
    name, adapter = adapter
    opened = http.post("/v1/sessions", json={"sampling_params": GREEDY, "adapter": {"name": name, "version": 1}})
    assert opened.status_code == 200, opened.text
    sid = opened.json()["session_id"]
    turn = http.post(f"/v1/sessions/{sid}/generate", json={"append_token_ids": adapter["prompt_token_ids"]})
    assert turn.status_code == 200, turn.text
    assert turn.json()["token_ids"] == adapter["samples"][0]["token_ids"]
    drew = adapter["samples"][0]["policy"]  # the rollout's, on the same version: its digest and base
    assert drew["adapter"] == name and turn.json()["policies"] == [drew]  # each turn records the policy that drew it
    (span,) = http.get(f"/v1/sessions/{sid}/trajectory").json()["segments"][-1]["turns"]
    assert span["policies"] == [drew]
    missing = http.post("/v1/sessions", json={"adapter": {"name": "nobody", "version": 1}})
    assert missing.status_code == 404


def test_a_tenants_session_is_its_own(http, adapter):
    _, adapter = adapter
    tokens = {}
    for t in ("sess-a", "sess-b"):
        tokens[t] = {"Authorization": f"Bearer {http.post(f'/v1/tenants/{t}', headers=ADMIN).json()['token']}"}
    sid = http.post("/v1/sessions", json={"sampling_params": GREEDY}, headers=tokens["sess-a"]).json()["session_id"]
    turn = {"append_token_ids": adapter["prompt_token_ids"]}
    assert http.post(f"/v1/sessions/{sid}/generate", json=turn, headers=tokens["sess-a"]).status_code == 200
    for route in ("", "/trajectory"):
        assert http.get(f"/v1/sessions/{sid}{route}", headers=tokens["sess-b"]).status_code == 404
        assert http.get(f"/v1/sessions/{sid}{route}").status_code == 404  # no token neither
        assert http.get(f"/v1/sessions/{sid}{route}", headers=tokens["sess-a"]).status_code == 200
    assert http.post(f"/v1/sessions/{sid}/generate", json=turn, headers=tokens["sess-b"]).status_code == 404
    assert http.post(f"/v1/sessions/{sid}/close", headers=tokens["sess-b"]).status_code == 404


def admitted(http, tenant: str) -> float:
    """The tenant's admitted requests, over every ingress replica (0 before its first)."""
    found = samples(http.get("/metrics").text, "farm_tenant_admissions_total")
    return sum(v for labels, v in found if labels.get("tenant") == tenant and labels.get("outcome") == "admitted")


def test_a_tenant_past_its_quota_gets_a_429_naming_it(http):
    token = http.post("/v1/tenants/quota-a", headers=ADMIN).json()["token"]
    bad = http.put("/v1/tenants/quota-a/quota", json={"in_flight_samples": 0}, headers=ADMIN)
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"].endswith("in_flight_samples")
    assert http.put("/v1/tenants/quota-a/quota", json={"in_flight_samples": 2}, headers=ADMIN).status_code == 200
    time.sleep(1.1)  # every ingress replica applies a quota within RECORDS_TTL_S (1 s)
    me = {"Authorization": f"Bearer {token}"}
    long = {"prompts": [{"text": "1"}], "n": 2, "request_id": "quota-long"}
    long["sampling_params"] = {"max_new_tokens": 4000, "ignore_eos": True, "seed": 1}
    before = admitted(http, "quota-a")
    first = threading.Thread(target=lambda: http.post("/v1/rollouts", json=long, headers=me), daemon=True)
    first.start()
    deadline = time.monotonic() + 60
    while admitted(http, "quota-a") <= before and time.monotonic() < deadline:  # the long one holds 2 samples now
        time.sleep(0.05)
    refused = http.post("/v1/rollouts", json={"prompts": [{"text": "2"}], "n": 1}, headers=me)
    assert refused.status_code == 429 and "quota-a" in refused.json()["error"]
    assert int(refused.headers["retry-after"]) >= 1
    other = rollout(http, prompts=[{"text": "2"}], n=1)  # negative control: the admin (another count) is admitted
    assert other.status_code == 200
    http.delete("/v1/rollouts/quota-long", headers=ADMIN)  # the long one ends at its next token
    first.join(60)
    assert rollout(http, prompts=[{"text": "2"}], n=1, headers=me).status_code == 200  # its samples left
