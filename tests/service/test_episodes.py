"""Episodes run in the farm (POST /v1/episodes), against the real service: the built-in calculator environment, the
limits, and environments that fail as remote sandboxes do (tests/farm_plugins.py:Flaky).

The model is the bench app's EchoEngine, the scripted agent model (tests/farm_plugins.py): it says the text between
the marks of the last `say:‹...›` in its prompt, so a prompt scripts the model's turns; everything else is real.
"""

import json

import httpx
import pytest

from rollout_farm.services.models import byte_tokenizer

PARAMS = {"max_new_tokens": 64, "temperature": 0.0}
CALL = 'call calculator {"expression": "3456*78"}'


def episodes(bench: str, body: dict) -> dict:
    r = httpx.post(f"{bench}/v1/episodes", json={"sampling_params": PARAMS, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_calculator_episodes_call_the_tool_and_score_the_answer(bench_service):
    prompts = [
        {"text": f"Q: 3456*78\nA: say:‹{CALL}›", "ground_truth": "269568"},  # calls the tool every turn
        {"text": "Q: 2+2\nA: say:‹#### 4›", "ground_truth": "4"},  # answers at once
    ]
    out = episodes(bench_service, {"env": {"name": "calculator"}, "prompts": prompts, "n": 2, "max_turns": 3})
    calls, answers = out["groups"]
    assert [g["prompt_index"] for g in out["groups"]] == [0, 1] and all(len(g["episodes"]) == 2 for g in out["groups"])
    for ep in calls["episodes"]:
        assert (ep["stop_reason"], ep["turns"], ep["tool_calls"], ep["reward"]) == ("max_turns", 3, 3, 0.0)
        (seg,) = ep["segments"]
        text = byte_tokenizer().decode(seg["token_ids"])
        assert text == f"Q: 3456*78\nA: say:‹{CALL}›" + f"{CALL}\n= 269568" * 2 + CALL  # the tool's answers between
        assert sum(seg["loss_mask"]) == 3 * len(CALL) and len(seg["turns"]) == 3
    for ep in answers["episodes"]:
        assert (ep["stop_reason"], ep["turns"], ep["tool_calls"], ep["reward"]) == ("done", 1, 0, 1.0)
    assert answers["reward_mean"] == 1.0 and answers["zero_variance"] and calls["reward_std"] == 0.0
    again = httpx.get(f"{bench_service}/v1/sessions/{ep['session_id']}/trajectory", timeout=30).json()
    assert again["closed"] and again["reward"] == 1.0 and again["segments"] == ep["segments"]


def test_episodes_stream_groups_as_they_finish(bench_service):
    body = {"env": {"name": "calculator"}, "prompts": [{"text": "Q: 1+1\nA: say:‹#### 2›", "ground_truth": "2"}] * 3}
    with httpx.stream(
        "POST", f"{bench_service}/v1/episodes", json={**body, "sampling_params": PARAMS, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    *groups, end = lines
    assert sorted(g["prompt_index"] for g in groups) == [0, 1, 2] and end == {
        "done": True,
        "groups": 3,
        "error": None,
        "status": None,
    }


@pytest.mark.parametrize(
    "behaviour, stop, error",
    [("raise", "env_error", "step: RuntimeError: the sandbox crashed"), ("hang_reset", "env_error", "reset answered")],
)
def test_an_environment_that_fails_ends_its_episode_only(bench_service, behaviour, stop, error):
    out = episodes(
        bench_service,
        {
            "env": {"name": "test_flaky", "params": {"behaviour": behaviour}},
            "prompts": [{"text": "say:‹hello›"}],
            "n": 2,
            "tool_timeout_s": 0.5,
        },
    )
    for ep in out["groups"][0]["episodes"]:
        assert ep["stop_reason"] == stop and ep["error"].startswith(error)


def test_a_step_that_hangs_gets_an_error_observation_not_a_hang(bench_service):
    out = episodes(
        bench_service,
        {
            "env": {"name": "test_flaky", "params": {"behaviour": "hang"}},
            "prompts": [{"text": "say:‹hello›"}],
            "max_turns": 2,
            "tool_timeout_s": 0.3,
        },
    )
    (ep,) = out["groups"][0]["episodes"]
    assert (ep["stop_reason"], ep["turns"], ep["error"]) == ("max_turns", 2, None)
    text = byte_tokenizer().decode(ep["segments"][0]["token_ids"])
    assert text == "say:‹hello›hello\nerror: the environment did not answer within 0.3 s" + "hello"


def test_the_limits_end_episodes_with_their_stop_reason(bench_service):
    endless = {"env": {"name": "test_flaky", "params": {"behaviour": "endless"}}, "prompts": [{"text": "x"}]}
    (ep,) = episodes(bench_service, {**endless, "max_turns": 10, "max_total_tokens": 100})["groups"][0]["episodes"]
    assert ep["stop_reason"] == "max_tokens" and sum(ep["segments"][0]["loss_mask"]) == 100  # 64 + 36
    long = {"max_new_tokens": 4096, "temperature": 0.0, "ignore_eos": True}  # the echo engine's context: 8192
    r = httpx.post(
        f"{bench_service}/v1/episodes", json={**endless, "max_turns": 10, "sampling_params": long}, timeout=120
    )
    (ep,) = r.json()["groups"][0]["episodes"]
    seg = ep["segments"][0]
    assert ep["stop_reason"] == "context_overflow" and ep["turns"] == 2 and len(seg["token_ids"]) == 8192


@pytest.mark.parametrize(
    "body, field",
    [
        ({"env": {"name": "no_such_env"}}, "env.name"),
        ({"env": {"name": "calculator", "params": {"rewardd": "gsm8k"}}}, "env.params.rewardd"),
        ({"env": {"name": "test_flaky", "params": {"behaviour": "explode"}}}, "env.params.behaviour"),
        ({"env": {"name": "calculator"}, "max_turns": 0}, "max_turns"),
    ],
)
def test_bad_episode_requests_name_the_field(bench_service, body, field):
    r = httpx.post(f"{bench_service}/v1/episodes", json={"prompts": [{"text": "x"}], **body}, timeout=30)
    assert r.status_code == 422 and field in r.text, r.text


def test_environments_are_listed(bench_service):
    envs = httpx.get(f"{bench_service}/v1/environments", timeout=30).json()["environments"]
    assert "calculator" in envs and "test_flaky" in envs


def test_an_episode_source_feeds_the_queue_with_masked_episode_groups(bench_service):
    from tests.service.helpers import AUTH

    prompt = {"text": f"Q: 3456*78\nA: say:‹{CALL}›", "ground_truth": "269568"}
    source = {
        "name": "episodes-q",
        "prompts": [prompt] * 2,
        "n": 2,
        "target_groups": 2,
        "sampling_params": PARAMS,
        "episodes": {"env": {"name": "calculator"}, "max_turns": 2},
    }
    bad = {**source, "name": "bad-q", "episodes": {"env": {"name": "calculatorr"}}}
    r = httpx.post(f"{bench_service}/v1/queue/sources", json=bad, headers=AUTH, timeout=30)
    assert r.status_code == 422 and "episodes.env.name" in r.text, r.text
    assert httpx.post(f"{bench_service}/v1/queue/sources", json=source, headers=AUTH, timeout=30).status_code == 200
    try:
        body = {"source": "episodes-q", "max_groups": 2, "wait_s": 60}
        items = httpx.post(f"{bench_service}/v1/queue/pull", json=body, headers=AUTH, timeout=120).json()["items"]
        assert len(items) == 2
        for item in items:
            group = item["group"]
            assert byte_tokenizer().decode(group["prompt_token_ids"]) == prompt["text"]
            for s in group["samples"]:
                observation = len("\n= 269568")
                assert s["loss_mask"] == [1] * len(CALL) + [0] * observation + [1] * len(CALL)
                assert byte_tokenizer().decode(s["token_ids"]) == f"{CALL}\n= 269568{CALL}"
                assert s["sampler_meta"]["tool_calls"] == 2 and s["finish_reason"] == "length"
    finally:
        httpx.delete(f"{bench_service}/v1/queue/sources/episodes-q", headers=AUTH, timeout=30)
