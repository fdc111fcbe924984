"""The OpenAI-compatible endpoints: shapes, usage, stop strings, logprobs, and 422s naming the field."""

import httpx
import pytest

from tests.service.helpers import rollout


def test_completions_shape_n_usage_and_stop(service):
    body = {"model": "any", "prompt": ["Q: 1+2\nA:", "hello"], "max_tokens": 12, "n": 2, "temperature": 1.0, "seed": 3}
    r = httpx.post(f"{service}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "text_completion" and [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] in ("stop", "length") and isinstance(c["text"], str) for c in out["choices"])
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] > 0
    first = out["choices"][0]["text"]
    stop = first[2:4] if len(first) >= 4 else None
    if stop:  # the same seeded request with a stop string taken from the first answer ends there
        cut = httpx.post(f"{service}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()["choices"][0]
        assert cut["text"] == first[: first.find(stop)] and cut["finish_reason"] == "stop"


def test_chat_completions_use_the_chat_template(service):
    body = {"messages": [{"role": "user", "content": "Q: 2+2"}], "max_completion_tokens": 8, "temperature": 0}
    r = httpx.post(f"{service}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    # "user: Q: 2+2\nassistant:" is 24 bytes, one token each in the byte-level tokenizer
    assert out["usage"]["prompt_tokens"] == len("user: Q: 2+2\nassistant:")


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/v1/completions", {"prompt": "x", "temperature": 3}, "temperature"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_openai_validation_errors_name_the_field(service, path, body, field):
    r = httpx.post(f"{service}{path}", json=body)
    assert r.status_code == 422 and any(d["field"] == field for d in r.json()["detail"]), r.json()


def test_completion_logprobs_join_to_the_text_and_match_the_rollout(service, fresh_weights):
    prompt = "Q: 12+3\nA:"
    r = httpx.post(
        f"{service}/v1/completions",
        json={"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert any(
        ord(ch) > 127 for ch in choice["text"]
    )  # the tiny model's greedy answer holds a character of two bytes, two tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 10 and "".join(lp["tokens"]) == choice["text"]
    same = rollout(
        service, {"prompts": [{"text": prompt}], "sampling_params": {"temperature": 0, "max_new_tokens": 10}}
    ).json()
    assert lp["token_logprobs"] == pytest.approx(same["groups"][0]["samples"][0]["logprobs"], abs=1e-5)
    assert all(x <= 0 for x in lp["token_logprobs"])
    plain = httpx.post(
        f"{service}/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=120
    ).json()
    assert plain["choices"][0]["logprobs"] is None


def test_unsupported_openai_fields_get_422_naming_them(service):
    for path, body, field in [
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {}},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop": ["x", ""]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ["s"] * 17}, "stop"),
        ("/v1/completions", {"prompt": [[1, 2], [10**9]]}, "prompt.1.token_ids"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ]:
        r = httpx.post(f"{service}{path}", json=body)
        assert r.status_code == 422 and any(d["field"].startswith(field) for d in r.json()["detail"]), (body, r.json())


def test_chat_logprobs_list_each_token(service, fresh_weights):
    body = {
        "messages": [{"role": "user", "content": "Q: 2+2"}],
        "max_completion_tokens": 8,
        "temperature": 0,
        "logprobs": True,
    }
    r = httpx.post(f"{service}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 8 and all(isinstance(c["token"], str) and c["logprob"] <= 0 for c in content)
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
