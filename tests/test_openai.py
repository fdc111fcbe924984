"""OpenAI-compatible endpoints, spoken to as an evaluation tool would: plain JSON over HTTP."""

import httpx
import pytest

pytestmark = pytest.mark.integration


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
        assert cut["text"] == first[:first.find(stop)] and cut["finish_reason"] == "stop"


def test_chat_completions_use_the_chat_template(service):
    body = {"messages": [{"role": "user", "content": "Q: 2+2"}], "max_completion_tokens": 8, "temperature": 0}
    r = httpx.post(f"{service}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    # "user: Q: 2+2\nassistant:" is 24 bytes, one token each in the byte-level tokenizer
    assert out["usage"]["prompt_tokens"] == len("user: Q: 2+2\nassistant:")


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "x", "temperature": 3}, "temperature"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
])
def test_openai_validation_errors_name_the_field(service, path, body, field):
    r = httpx.post(f"{service}{path}", json=body)
    assert r.status_code == 422 and any(d["field"] == field for d in r.json()["detail"]), r.json()
