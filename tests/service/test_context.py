"""A prompt plus max_new_tokens beyond the model's context is a 422 giving both numbers, on every surface that takes
prompts: /v1/rollouts (token ids and text, which the service tokenizes to count), queue sources and the prompts added
to them (refused when added, not during background generation), and SGLang's /generate. Just within it: 200."""

import httpx

from tests.conftest import CONTEXT
from tests.service.helpers import AUTH, greedy, rollout


def detail(r: httpx.Response) -> dict:
    assert r.status_code == 422, r.text
    (d,) = r.json()["detail"]
    return d


def test_a_prompt_longer_than_the_context_is_422_naming_the_prompt(service):
    d = detail(rollout(service, greedy([[1] * 6000], max_new_tokens=8)))
    assert d == {
        "field": "prompts.0",
        "message": f"prompt 0 has 6000 tokens + max_new_tokens 8 = 6008 > the model's context of {CONTEXT}: "
        "shorten the prompt",
    }


def test_prompt_plus_max_new_tokens_just_over_the_context_is_422_and_just_within_is_200(service):
    prompt = CONTEXT - 8
    d = detail(rollout(service, greedy([[40, 41], [1] * prompt], max_new_tokens=9)))
    assert d["field"] == "sampling_params.max_new_tokens"
    assert d["message"] == (
        f"prompt 1 has {prompt} tokens + max_new_tokens 9 = {CONTEXT + 1} > the model's context of {CONTEXT}: "
        "shorten the prompt or lower max_new_tokens to at most 8"
    )
    text = detail(rollout(service, {**greedy([], max_new_tokens=9), "prompts": [{"text": "x" * prompt}]}))
    assert f"{prompt} tokens + max_new_tokens 9" in text["message"]  # a text prompt is tokenized to count it
    ok = rollout(service, greedy([[1] * prompt], max_new_tokens=8, ignore_eos=True))
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["groups"][0]["samples"][0]["token_ids"]) == 8


def test_queue_sources_and_added_prompts_are_refused_when_added(service):
    source = {"name": "too-long", "prompts": [{"token_ids": [1] * CONTEXT}], "sampling_params": {"max_new_tokens": 4}}
    d = detail(httpx.post(f"{service}/v1/queue/sources", json=source, headers=AUTH))
    assert d["field"] == "prompts.0" and f"{CONTEXT} tokens + max_new_tokens 4" in d["message"]
    assert httpx.get(f"{service}/v1/queue/sources").json() == []  # nothing registered
    ok = {**source, "prompts": [], "target_groups": 1}
    assert httpx.post(f"{service}/v1/queue/sources", json=ok, headers=AUTH).status_code == 200
    try:
        added = {"prompts": [{"text": "fine"}, {"text": "x" * (CONTEXT - 3)}]}
        d = detail(httpx.post(f"{service}/v1/queue/sources/too-long/prompts", json=added, headers=AUTH))
        assert d["field"] == "sampling_params.max_new_tokens" and "prompt 1 has" in d["message"]
        assert "at most 3" in d["message"]
        (state,) = httpx.get(f"{service}/v1/queue/sources").json()
        assert state["pending_prompts"] == 0  # neither prompt was added
    finally:
        httpx.delete(f"{service}/v1/queue/sources/too-long", headers=AUTH)


def test_sglang_generate_gives_the_same_422_under_its_own_field_names(service):
    body = {"input_ids": [[40, 41], [1] * 6000], "sampling_params": {"max_new_tokens": 8}}
    d = detail(httpx.post(f"{service}/generate", json=body, timeout=60))
    assert d["field"] == "input_ids.1" and "6000 tokens + max_new_tokens 8 = 6008" in d["message"]
