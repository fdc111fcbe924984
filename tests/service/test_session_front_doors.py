"""A session's other front doors against the real service: Anthropic's Messages API through the official `anthropic`
SDK, OpenAI's Responses API through the `openai` SDK, and vLLM's return_token_ids on chat. Each door is one more way
into the same session turns: the tokens stored are the engine's sampled ids, the loss mask is 1 exactly on them.

The model is the bench app's EchoEngine (tests/farm_plugins.py), the scripted agent model of
tests/service/test_session_chat.py: it answers the text between the marks of the last `say:‹...›` in its prompt, so
the test scripts each turn's tool call through the messages it sends (a fake of the model only: no model small
enough to run here writes tool calls). Its tokenizer is the byte tokenizer: a token a byte.
"""

import json

import httpx
import pytest
from anthropic import Anthropic, UnprocessableEntityError
from openai import OpenAI

from rollout_farm.services.models import byte_tokenizer
from tests.service.test_session_chat import CALC, calculator, call_text, chat, opened, trajectory

CALC_ANTHROPIC = {
    "name": "calculator",
    "description": CALC["function"]["description"],
    "input_schema": CALC["function"]["parameters"],
}
CALC_RESPONSES = {"type": "function", **CALC["function"], "strict": False}
SCRIPTS = ["37*48", "1776+1"]  # the calls the loops make, then an answer


def said(answer_ids: list[list[int]]) -> list[str]:
    return [byte_tokenizer().decode(ids) for ids in answer_ids]


def script_after(k: int, result: str) -> str:
    """The tool result of call k, with the next turn's script."""
    nxt = call_text(SCRIPTS[k + 1]) if k + 1 < len(SCRIPTS) else f"It is {result}."
    return f"{result} say:‹{nxt}›"


def assert_exact(bench: str, sid: str, farms: list[dict]) -> None:
    """One segment (no fork), one turn per answer, each turn's stored ids the answer's (the engine's output, which
    for the echo model is its script's bytes), the loss mask 1 exactly on the sampled tokens."""
    (seg,) = trajectory(bench, sid)["segments"]
    assert len(seg["turns"]) == len(farms)
    sampled = set()
    for farm, span in zip(farms, seg["turns"]):
        assert seg["token_ids"][span["start"] : span["end"]] == farm["token_ids"]
        sampled |= set(range(span["start"], span["end"]))
    assert [i for i, m in enumerate(seg["loss_mask"]) if m] == sorted(sampled)
    scripts = [call_text(SCRIPTS[0]), call_text(SCRIPTS[1]), "It is 1777."]
    assert said([f["token_ids"] for f in farms]) == scripts


def anthropic_client(base_url: str) -> Anthropic:
    return Anthropic(base_url=f"{base_url}/anthropic", api_key="unused", max_retries=0)


@pytest.mark.parametrize("streamed", [False, True])
def test_the_anthropic_sdk_runs_a_tool_loop_on_a_session(bench_service, streamed):
    s = opened(bench_service)
    client = anthropic_client(s["base_url"])
    messages = [{"role": "user", "content": f"What is 37*48? say:‹{call_text(SCRIPTS[0])}›"}]
    farms, calls = [], 0
    for _ in range(4):
        ask = dict(model="farm", max_tokens=96, system="You can use a calculator.", messages=messages)
        if streamed:
            with client.messages.stream(**ask, tools=[CALC_ANTHROPIC]) as stream:
                reply = stream.get_final_message()
        else:
            reply = client.messages.create(**ask, tools=[CALC_ANTHROPIC])
        farms.append(reply.farm)
        messages.append({"role": "assistant", "content": reply.content})  # sent back as the SDK gave it
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        assert reply.stop_reason == "tool_use" and reply.usage.output_tokens == len(farms[-1]["token_ids"])
        results = []
        for use in uses:
            result = calculator(use.input["expression"])
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": script_after(calls, result)})
            calls += 1
        messages.append({"role": "user", "content": results})
    assert calls == 2 and reply.stop_reason == "end_turn"
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == "It is 1777."
    assert_exact(bench_service, s["session_id"], farms)
    counted = client.messages.count_tokens(model="farm", system="You can use a calculator.", messages=messages[:1])
    assert counted.input_tokens == trajectory(bench_service, s["session_id"])["segments"][0]["turns"][0]["start"]


@pytest.mark.parametrize("streamed", [False, True])
def test_the_openai_responses_api_runs_a_tool_loop_on_a_session(bench_service, streamed):
    """Plain: previous_response_id carries the history, under {base_url}/v1. Streamed: the client sends its whole
    history of input items, under the session's base_url itself."""
    s = opened(bench_service)
    client = OpenAI(base_url=s["base_url"] if streamed else f"{s['base_url']}/v1", api_key="unused", max_retries=0)
    items = [{"role": "user", "content": f"What is 37*48? say:‹{call_text(SCRIPTS[0])}›"}]
    farms, calls, previous = [], 0, None
    for _ in range(4):
        ask = dict(model="farm", instructions="You can use a calculator.", tools=[CALC_RESPONSES])
        if streamed:
            with client.responses.stream(**ask, input=items) as stream:
                reply = stream.get_final_response()
        else:
            reply = client.responses.create(**ask, input=items, previous_response_id=previous)
        farms.append(reply.farm)
        fresh = [o.model_dump(exclude_none=True) for o in reply.output]
        items, previous = (items + fresh if streamed else []), reply.id
        fcs = [o for o in reply.output if o.type == "function_call"]
        if not fcs:
            break
        for fc in fcs:
            out = script_after(calls, calculator(json.loads(fc.arguments)["expression"]))
            items.append({"type": "function_call_output", "call_id": fc.call_id, "output": out})
            calls += 1
    assert calls == 2 and reply.status == "completed" and reply.output_text == "It is 1777."
    assert reply.usage.output_tokens == len(farms[-1]["token_ids"])
    assert_exact(bench_service, s["session_id"], farms)


def test_return_token_ids_gives_the_prompt_and_sampled_ids(bench_service):
    """vLLM's names: top-level prompt_token_ids, choices[0].token_ids; on a session, the prompt is the segment's
    tokens before the turn; streamed, the first chunk carries them."""
    s = opened(bench_service)
    sid = s["session_id"]
    body = {"messages": [{"role": "user", "content": "hi say:‹yo›"}], "return_token_ids": True}
    answer = chat(bench_service, sid, body).json()
    (seg,) = trajectory(bench_service, sid)["segments"]
    start = seg["turns"][0]["start"]
    assert answer["prompt_token_ids"] == seg["token_ids"][:start]
    assert answer["choices"][0]["token_ids"] == answer["farm"]["token_ids"] == seg["token_ids"][start:]
    client = OpenAI(base_url=s["base_url"], api_key="unused", max_retries=0)
    asked = {"model": "farm", "messages": body["messages"], "extra_body": {"return_token_ids": True}}
    chunks = list(client.chat.completions.create(**asked, stream=True))
    assert chunks[0].prompt_token_ids == answer["prompt_token_ids"]  # the same turn, a retry
    assert chunks[0].choices[0].token_ids == answer["choices"][0]["token_ids"]
    plain = {k: v for k, v in body.items() if k != "return_token_ids"}
    assert "prompt_token_ids" not in chat(bench_service, sid, plain).json()
    alone = httpx.post(f"{bench_service}/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=60).json()
    assert byte_tokenizer().decode(alone["prompt_token_ids"]).endswith("hi say:‹yo›")
    assert len(alone["choices"][0]["token_ids"]) == alone["usage"]["completion_tokens"]


def refused(r: httpx.Response, field: str) -> None:
    assert r.status_code == 422, r.text
    assert any(d["field"].startswith(field) for d in r.json()["detail"]), r.text


def test_bad_front_door_requests_are_refused_naming_the_field(bench_service):
    s = opened(bench_service)
    sid, base = s["session_id"], s["base_url"]
    unknown = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]
    with pytest.raises(UnprocessableEntityError) as e:
        anthropic_client(base).messages.create(model="farm", max_tokens=8, messages=unknown)
    assert e.value.body["detail"][0]["field"] == "messages.0.content.0.tool_use_id"
    image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
    ask = {"model": "farm", "max_tokens": 8, "messages": [{"role": "user", "content": [image]}]}
    refused(httpx.post(f"{base}/anthropic/v1/messages", json=ask, timeout=30), "messages.0.content")
    thinking = {**ask, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    refused(httpx.post(f"{base}/anthropic/v1/messages", json=thinking, timeout=30), "thinking")
    other = opened(bench_service)
    first = httpx.post(f"{other['base_url']}/responses", json={"input": "hi say:‹yo›"}, timeout=30).json()
    borrowed = {"input": "go on", "previous_response_id": first["id"]}
    refused(httpx.post(f"{base}/v1/responses", json=borrowed, timeout=30), "previous_response_id")
    ref = {"input": [{"type": "item_reference", "id": "msg_1"}]}
    refused(httpx.post(f"{base}/v1/responses", json=ref, timeout=30), "input")
    assert trajectory(bench_service, sid)["segments"][0]["token_ids"] == []  # nothing stored
    assert httpx.post(f"{bench_service}/v1/sessions/{'0' * 32}/v1/responses", json={"input": "x"}).status_code == 404
