"""vLLM's token route on the farm, POST /inference/v1/generate, with plain httpx requests in the shape verifiers'
training client sends through `renderers` 0.1.12 (client.py: model, token_ids, sampling_params with logprobs 1 and
stop_token_ids), checked the way that client checks an answer: one logprob entry per generated token, each
`"token": "token_id:<id>"` with a finite logprob. The samples are the farm's own: the same seed gives the same ids and
logprobs as POST /v1/rollouts."""

import math

import httpx
import pytest

SEEDED = {"temperature": 1.0, "max_tokens": 8, "seed": 11, "ignore_eos": True}


def generate(service: str, body: dict) -> httpx.Response:
    return httpx.post(f"{service}/inference/v1/generate", json=body, timeout=120)


def test_the_answer_is_what_renderers_reads_and_the_farms_own_samples(service):
    eos = httpx.get(f"{service}/v1/models", timeout=30).json()
    model = eos["data"][0]["id"]
    assert eos["data"][0]["max_model_len"] == eos["data"][0]["meta"]["context_length"] > 0
    body = {
        "model": model,
        "token_ids": [40, 41, 42],
        "sampling_params": {**SEEDED, "logprobs": 1, "skip_special_tokens": False, "stop_token_ids": [2]},
        "cache_salt": "episode-7",
    }
    r = generate(service, body)
    assert r.status_code == 200, r.text
    out = r.json()
    (choice,) = out["choices"]
    ids = choice["token_ids"]
    assert 1 <= len(ids) <= 8 and choice["finish_reason"] in ("stop", "length")
    entries = choice["logprobs"]["content"]
    assert len(entries) == len(ids)  # renderers: exactly one entry per generated token
    for token, e in zip(ids, entries):
        assert e["token"] == f"token_id:{token}" and e["token_id"] == token  # vLLM <= 0.31's and >= 0.32's shapes
        assert math.isfinite(e["logprob"]) and e["logprob"] != -9999.0 and e["top_logprobs"][0]["token_id"] == token
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": len(ids),
        "total_tokens": 3 + len(ids),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert out["prompt_token_ids"] is None and out["model"] == model
    assert isinstance(choice["farm"]["weight_version"], int)
    # the farm's own rollout of the same prompt, seed and params: the same ids and logprobs
    farm = {"temperature": 1.0, "max_new_tokens": 8, "seed": 11, "ignore_eos": True, "stop_token_ids": [2]}
    own = httpx.post(
        f"{service}/v1/rollouts", json={"prompts": [{"token_ids": [40, 41, 42]}], "sampling_params": farm}, timeout=120
    ).json()["groups"][0]["samples"][0]
    assert own["token_ids"] == ids
    assert own["logprobs"] == pytest.approx([e["logprob"] for e in entries], abs=1e-5)


def test_n_samples_the_prompt_echo_and_no_logprobs(service):
    body = {"token_ids": [40, 41], "sampling_params": {**SEEDED, "n": 3}, "return_token_ids": True}
    out = generate(service, body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2] and out["prompt_token_ids"] == [40, 41]
    assert all(c["logprobs"] is None and len(c["token_ids"]) == 8 for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize(
    "body, field",
    [
        ({"token_ids": [40], "sampling_params": {"reasoning_effort": "high"}}, "sampling_params.reasoning_effort"),
        ({"token_ids": [40], "sampling_params": {"min_p": 0.1}}, "sampling_params.min_p"),
        ({"token_ids": [40], "sampling_params": {"logprobs": 5}}, "sampling_params.logprobs"),
        ({"token_ids": [40], "stream": True}, "stream"),
        ({"token_ids": [40], "priority": 3}, "priority"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [10**9]}, "token_ids"),
        ({"token_ids": [40], "sampling_params": {"max_tokens": 10**6}}, "sampling_params.max_tokens"),
        ({"token_ids": [40], "model": "no-such-adapter@v3"}, "model"),
    ],
)
def test_what_the_farm_cannot_honour_is_refused_naming_the_field(service, body, field):
    """vLLM drops unknown sampling_params keys silently; the farm names them (a 4xx, nothing sampled)."""
    r = generate(service, body)
    assert r.status_code in (404, 422), r.text
    assert any(d["field"] == field for d in r.json()["detail"]), r.text


def test_on_a_session_the_whole_prompt_each_turn_appends_forks_and_retries(service):
    """A vLLM client with a session's base URL sends the whole prompt every turn (renderers posts to the base URL
    less /v1, plus /inference/v1/generate). What follows the session's tokens appends (one segment); a prompt that
    leaves them forks where they part; an answered turn's prompt again gets that turn; the stored ids and logprobs
    are the answers', the loss mask 1 exactly on them. Negative control: a rewritten prompt is not taken as an
    append (its own segment, its parent's tokens up to the cut)."""
    s = httpx.post(f"{service}/v1/sessions", json={}, timeout=30).json()
    url = f"{s['base_url']}/inference/v1/generate"

    def turn(ids: list[int]) -> dict:
        r = httpx.post(url, json={"token_ids": ids, "sampling_params": {**SEEDED, "logprobs": 1}}, timeout=120)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert [e["token_id"] for e in choice["logprobs"]["content"]] == choice["token_ids"]
        return choice

    first = turn([40, 41, 42])
    prompt2 = [40, 41, 42, *first["token_ids"], 43, 44]
    second = turn(prompt2)
    assert (second["farm"]["segment_id"], second["farm"]["turn"]) == (first["farm"]["segment_id"], 1)
    assert turn(prompt2) == second  # a retry: the stored turn, not a new sample
    trajectory = httpx.get(f"{s['base_url']}/trajectory", timeout=30).json()
    (seg,) = trajectory["segments"]
    assert seg["token_ids"] == prompt2 + second["token_ids"]
    sampled = [*range(3, 3 + len(first["token_ids"])), *range(len(prompt2), len(seg["token_ids"]))]
    assert [i for i, m in enumerate(seg["loss_mask"]) if m] == sampled
    assert seg["logprobs"][len(prompt2) :] == pytest.approx([e["logprob"] for e in second["logprobs"]["content"]])
    rewritten = turn([40, 41, 99])  # leaves the session's tokens after two: a fork
    assert rewritten["farm"]["segment_id"] != first["farm"]["segment_id"]
    forked = httpx.get(f"{s['base_url']}/trajectory", timeout=30).json()["segments"][-1]
    assert (forked["parent"], forked["parent_tokens"]) == (seg["segment_id"], 2)
    assert forked["token_ids"][:3] == [40, 41, 99] and forked["loss_mask"][:3] == [0, 0, 0]
    r = httpx.post(url, json={"token_ids": [1], "sampling_params": {**SEEDED, "n": 2}}, timeout=30)
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "sampling_params.n"
