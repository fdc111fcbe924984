"""Sessions, token level, against the real service: sampled ids appended verbatim, every turn's prompt the stored
tokens exactly (checked against a plain greedy rollout of those tokens), retries, forks, rewards, bad input."""

import time

import httpx
import pytest

from tests.service.helpers import AUTH, rollout

GREEDY = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}


def call(service: str, method: str, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.request(method, f"{service}{path}", json=body, timeout=120, **kw)


def opened(service: str, **extra) -> dict:
    r = call(service, "POST", "/v1/sessions", {"sampling_params": GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def turn(service: str, sid: str, body: dict) -> dict:
    r = call(service, "POST", f"/v1/sessions/{sid}/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def trajectory(service: str, sid: str) -> dict:
    r = call(service, "GET", f"/v1/sessions/{sid}/trajectory")
    assert r.status_code == 200, r.text
    return r.json()


def test_each_turn_samples_from_the_stored_tokens_and_appends_its_ids_verbatim(service):
    s = opened(service, group_id="g7")
    assert s["base_url"].endswith(f"/v1/sessions/{s['session_id']}") and s["group_id"] == "g7"
    expected, answers = [], []
    for appended in ([40, 41, 42], [50, 51], [60]):
        got = turn(service, s["session_id"], {"append_token_ids": appended})
        expected += appended
        assert got["prompt_tokens"] == len(expected) and len(got["token_ids"]) == 5
        answers.append((list(expected), got))
        expected += got["token_ids"]
    (seg,) = trajectory(service, s["session_id"])["segments"]
    assert seg["token_ids"] == expected and seg["parent"] is None
    sampled = {i for _, a in answers for i in range(a["prompt_tokens"], a["prompt_tokens"] + 5)}
    assert [i for i, m in enumerate(seg["loss_mask"]) if m] == sorted(sampled)
    assert all(seg["token_versions"][i] == -1 for i in range(len(expected)) if i not in sampled)
    for prompt, got in answers:  # the engine saw exactly the stored tokens: a plain rollout of them agrees
        r = rollout(service, {"prompts": [{"token_ids": prompt}], "n": 1, "sampling_params": GREEDY})
        plain = r.json()["groups"][0]
        assert plain["prompt_token_ids"] == prompt and plain["samples"][0]["token_ids"] == got["token_ids"]
        assert plain["samples"][0]["logprobs"] == pytest.approx(got["logprobs"], abs=1e-5)
        span = slice(got["prompt_tokens"], got["prompt_tokens"] + 5)
        assert (
            seg["logprobs"][span] == pytest.approx(got["logprobs"])
            and seg["token_versions"][span] == (got["token_weight_versions"])
        )


def test_a_retry_gets_the_stored_turn_and_other_ids_for_it_are_refused(service):
    sid = opened(service)["session_id"]
    first = turn(service, sid, {"append_token_ids": [40, 41], "turn": 0})
    turn(service, sid, {"append_token_ids": [50], "turn": 1})
    again = turn(service, sid, {"append_token_ids": [40, 41], "turn": 0})
    assert again == first and len(trajectory(service, sid)["segments"][0]["token_ids"]) == 2 + 5 + 1 + 5
    other = call(service, "POST", f"/v1/sessions/{sid}/generate", {"append_token_ids": [40, 43], "turn": 0})
    assert other.status_code == 409 and "offset=0" in other.json()["error"]
    ahead = call(service, "POST", f"/v1/sessions/{sid}/generate", {"append_token_ids": [1], "turn": 5})
    assert ahead.status_code == 422 and ahead.json()["detail"][0]["field"] == "turn"


def test_an_offset_rewrites_in_a_new_segment_that_names_its_parent(service):
    sid = opened(service)["session_id"]
    first = turn(service, sid, {"append_token_ids": [40, 41]})
    turn(service, sid, {"append_token_ids": [50]})
    cut = first["prompt_tokens"] + len(first["token_ids"])
    forked = turn(service, sid, {"append_token_ids": [55, 56], "offset": cut})
    parent, fork = trajectory(service, sid)["segments"]
    assert (fork["segment_id"], fork["parent"], fork["parent_tokens"]) == (forked["segment_id"], "0", cut)
    assert fork["token_ids"][:cut] == parent["token_ids"][:cut] and set(fork["loss_mask"][:cut]) == {0}
    assert fork["token_ids"][cut:] == [55, 56] + forked["token_ids"] and forked["prompt_tokens"] == cut + 2
    assert len(parent["token_ids"]) == cut + 1 + 5  # the parent is kept as it was


def test_rewards_close_and_refusals_name_the_field(service):
    sid = opened(service)["session_id"]
    turn(service, sid, {"append_token_ids": [40]})
    assert call(service, "POST", f"/v1/sessions/{sid}/reward", {"reward": 0.5, "turn": 0}).status_code == 200
    assert call(service, "POST", f"/v1/sessions/{sid}/reward", {"reward": 1.0}).status_code == 200
    got = trajectory(service, sid)
    assert got["reward"] == 1.0 and got["segments"][0]["turns"][0]["reward"] == 0.5
    assert call(service, "POST", f"/v1/sessions/{sid}/close").json()["closed"] is True
    assert call(service, "POST", f"/v1/sessions/{sid}/generate", {"append_token_ids": [1]}).status_code == 409

    def field(r: httpx.Response) -> str:
        assert r.status_code == 422, r.text
        return r.json()["detail"][0]["field"]

    assert field(call(service, "POST", "/v1/sessions", {"tool_format": "xml"})) == "tool_format"
    fresh = opened(service)["session_id"]
    assert field(call(service, "POST", f"/v1/sessions/{fresh}/generate", {"append_token_ids": []})) == (
        "append_token_ids"
    )
    assert field(call(service, "POST", f"/v1/sessions/{fresh}/generate", {"append_token_ids": [1], "offset": 9})) == (
        "offset"
    )
    assert field(call(service, "POST", "/v1/sessions", {"sampling_params": {"temperature": -1}})).startswith(
        "sampling_params"
    )
    missing = call(service, "POST", "/v1/sessions/nope/generate", {"append_token_ids": [1]})
    assert missing.status_code == 404 and "POST /v1/sessions" in missing.json()["error"]
    gone = call(service, "GET", f"/v1/sessions/{'0' * 32}")
    assert gone.status_code == 404 and "expired" in gone.json()["error"]
    lock = call(service, "GET", f"/v1/sessions/{fresh}:lock/trajectory")  # another key of the session: not a session
    assert lock.status_code == 404


def test_sessions_expire_and_listing_and_deleting_need_the_token(service):
    short = opened(service, ttl_s=1)["session_id"]
    kept = opened(service)["session_id"]
    assert call(service, "GET", "/v1/sessions").status_code == 401
    listed = call(service, "GET", "/v1/sessions", headers=AUTH).json()["sessions"]
    assert {short, kept} <= set(listed)
    time.sleep(2.2)
    assert call(service, "GET", f"/v1/sessions/{short}").status_code == 404  # expired ttl_s after its last change
    assert call(service, "DELETE", f"/v1/sessions/{kept}").status_code == 401
    assert call(service, "DELETE", f"/v1/sessions/{kept}", headers=AUTH).json() == {"session_id": kept, "deleted": True}
    assert call(service, "GET", f"/v1/sessions/{kept}").status_code == 404


def test_a_weight_commit_in_the_middle_of_a_session_shows_in_its_token_versions(service, client, tiny_model):
    sid = opened(service)["session_id"]
    first = turn(service, sid, {"append_token_ids": [40, 41]})
    version = client.weights_version().version + 1
    client.push_weights((tiny_model / "model.safetensors").read_bytes(), version)
    second = turn(service, sid, {"append_token_ids": [50]})
    assert set(first["token_weight_versions"]) == {version - 1} and set(second["token_weight_versions"]) == {version}
    (seg,) = trajectory(service, sid)["segments"]
    sampled = [v for v, m in zip(seg["token_versions"], seg["loss_mask"]) if m]
    assert sampled == [version - 1] * 5 + [version] * 5  # each token says which weights sampled it
