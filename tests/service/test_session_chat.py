"""Sessions, chat level, against the real service: OpenAI chat with tools on a session's tokens.

The model is the bench app's EchoEngine (tests/farm_plugins.py), a scripted agent model: it answers a prompt holding
`say:‹...›` with the text between the marks, so each turn's tool call (or malformed call, or answer) is scripted by
the messages the test sends. It is a fake of the model only, for what cannot run here (no model small enough to
train in a test writes tool calls); the service, its HTTP, Redis, tokenizer and chat template are real. Its
tokenizer is the embedded byte tokenizer, whose template joins the messages' contents with newlines.
"""

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from rollout_farm.services.models import byte_tokenizer
from tests.service.helpers import metric

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
PARAMS = {"max_new_tokens": 96, "temperature": 0.0}  # the longest scripted turn is 84 bytes


def opened(bench: str, **extra) -> dict:
    r = httpx.post(f"{bench}/v1/sessions", json={"sampling_params": PARAMS, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat(bench: str, sid: str, body: dict) -> httpx.Response:
    return httpx.post(f"{bench}/v1/sessions/{sid}/chat/completions", json=body, timeout=60)


def trajectory(bench: str, sid: str) -> dict:
    r = httpx.get(f"{bench}/v1/sessions/{sid}/trajectory", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def call_text(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def calculator(expression: str) -> str:
    a, op, b = re.fullmatch(r"(\d+)([*+-])(\d+)", expression).groups()
    return str({"*": int(a) * int(b), "+": int(a) + int(b), "-": int(a) - int(b)}[op])


def test_an_openai_sdk_tool_loop_runs_on_the_session_url(bench_service):
    s = opened(bench_service)
    client = OpenAI(base_url=s["base_url"], api_key="unused", max_retries=0)
    messages = [
        {"role": "system", "content": "You can use a calculator."},
        {"role": "user", "content": f"What is 37*48? say:‹{call_text('37*48')}›"},
    ]
    calls = 0
    for _ in range(4):  # the agent loop of the openai SDK's function-calling guide
        reply = client.chat.completions.create(model="farm", messages=messages, tools=[CALC]).choices[0]
        messages.append(reply.message)
        if not reply.message.tool_calls:
            break
        assert reply.finish_reason == "tool_calls"
        for c in reply.message.tool_calls:
            calls += 1
            result = calculator(json.loads(c.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": c.id, "content": f"{result} say:‹It is {result}.›"})
    assert calls == 1 and reply.message.content == "It is 1776." and reply.finish_reason == "stop"
    (seg,) = trajectory(bench_service, s["session_id"])["segments"]
    said = [call_text("37*48"), "It is 1776."]  # what the model sampled
    assert byte_tokenizer().decode(seg["token_ids"]).endswith(f"›{said[0]}\n1776 say:‹It is 1776.›{said[1]}")
    assert sum(seg["loss_mask"]) == sum(len(t.encode()) for t in said)  # the two sampled turns, nothing else


def test_a_streaming_agent_gets_its_turn_in_chunks_and_sends_its_calls_back_with_their_index(bench_service):
    """Clients that stream (the SDK's stream=True; verifiers' relay always streams) get the turn as server-sent
    events, and accumulate tool calls that carry their `index`, which they send back: the next turn appends to the
    same segment, no fork; an index that is not the call's position is refused."""
    s = opened(bench_service)
    sid, client = s["session_id"], OpenAI(base_url=s["base_url"], api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": f"What is 37*48? say:‹{call_text('37*48')}›"}]
    chunks = list(
        client.chat.completions.create(
            model="farm", messages=messages, tools=[CALC], stream=True, stream_options={"include_usage": True}
        )
    )
    calls = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
    finished = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert finished == ["tool_calls"] and [(c.index, c.function.name) for c in calls] == [(0, "calculator")]
    assert json.loads(calls[0].function.arguments) == {"expression": "37*48"}
    assert chunks[-1].usage.completion_tokens == len(call_text("37*48").encode())  # the byte model: a token a byte
    retried = chat(bench_service, sid, {"messages": messages, "tools": [CALC]}).json()  # the same turn, not streamed
    assert retried["choices"][0]["message"]["tool_calls"][0]["id"] == calls[0].id
    sent = {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump(exclude_none=True)]}
    assert sent["tool_calls"][0]["index"] == 0
    answer = {"role": "tool", "tool_call_id": calls[0].id, "content": "1776 say:‹It is 1776.›"}
    wrong = {**sent, "tool_calls": [{**sent["tool_calls"][0], "index": 1}]}
    r = chat(bench_service, sid, {"messages": [*messages, wrong, answer], "tools": [CALC]})
    assert r.status_code == 422 and "index" in r.text, r.text
    r = chat(bench_service, sid, {"messages": [*messages, sent, answer], "tools": [CALC]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "It is 1776.", r.text
    (segment,) = trajectory(bench_service, sid)["segments"]  # appended: the index is not part of the history
    assert sum(segment["loss_mask"]) == len(call_text("37*48").encode()) + len(b"It is 1776.")


def scripted_episode(bench: str, seed: int, tool_format: str = "hermes") -> dict:
    """One tool episode of 2 to 8 turns with random tool results and, now and then, a malformed call; returns what
    the client saw, to check against the stored trajectory."""
    rng = random.Random(seed)
    s = opened(bench, tool_format=tool_format, malformed_tool_calls="mask" if seed % 2 else "train")
    turns = rng.randint(2, 8)
    messages = [{"role": "user", "content": f"episode {seed} say:‹{call_text(f'{rng.randint(2, 99)}*7')}›"}]
    seen = []
    for t in range(turns):
        r = chat(bench, s["session_id"], {"messages": messages, "tools": [CALC]})
        assert r.status_code == 200, r.text
        answer = r.json()
        seen.append(answer)
        message = answer["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        last = t == turns - 1
        script = (
            "done."
            if last
            else ("<tool_call>{not json</tool_call>" if rng.random() < 0.2 else call_text(f"{rng.randint(2, 999)}+1"))
        )
        if message.get("tool_calls"):
            result = str(rng.randint(0, 10**6))  # a random tool result
            messages.append(
                {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": f"{result} say:‹{script}›"}
            )
        else:
            messages.append({"role": "user", "content": f"go on say:‹{script}›"})
    return {"session": s, "masks_malformed": bool(seed % 2), "answers": seen, "messages": messages}


@pytest.fixture(scope="module")
def episodes(bench_service):
    """200 scripted hermes episodes, and how much the tool-call counters rose meanwhile (read before and after; the
    service exports them at 0 from its start, so no earlier session is needed and the tests pass alone)."""
    before = {
        name: metric(bench_service, name, format="hermes")
        for name in ("farm_tool_calls_total", "farm_tool_parse_errors_total")
    }
    with ThreadPoolExecutor(16) as pool:
        done = list(pool.map(lambda seed: scripted_episode(bench_service, seed), range(200)))
    after = {name: metric(bench_service, name, format="hermes") for name in before}
    return done, {name: after[name] - before[name] for name in before}


def test_200_scripted_tool_episodes_keep_their_sampled_ids_exactly(bench_service, episodes):
    tok = byte_tokenizer()
    done, _ = episodes
    for ep in done:
        traj = trajectory(bench_service, ep["session"]["session_id"])
        (seg,) = traj["segments"]  # the client only ever extended its history: no fork
        assert len(seg["turns"]) == len(ep["answers"])
        for answer, span in zip(ep["answers"], seg["turns"]):
            ids = answer["farm"]["token_ids"]
            assert seg["token_ids"][span["start"] : span["end"]] == ids  # the engine's output ids, verbatim
            assert answer["usage"]["prompt_tokens"] == span["start"]
            masked = ep["masks_malformed"] and answer["farm"]["malformed_tool_calls"]
            assert seg["loss_mask"][span["start"] : span["end"]] == [0 if masked else 1] * len(ids)
            assert answer["farm"]["trained"] == (not masked)
        sampled = {i for span in seg["turns"] for i in range(span["start"], span["end"])}
        assert all(m == 0 for i, m in enumerate(seg["loss_mask"]) if i not in sampled)  # template and observations
        assert seg["token_ids"] == expected_tokens(tok, ep)


def expected_tokens(tok, ep: dict) -> list[int]:
    """The session's tokens built independently: the template (contents joined by newlines, no generation prompt)
    renders each request's new messages, and each sampled turn's ids follow as the engine gave them."""
    history = [m for m in ep["messages"] if m["role"] != "assistant"]
    first = 1  # the opening request held one message
    ids = tok.encode(history[0]["content"], add_special_tokens=False)
    for answer in ep["answers"][:-1]:
        ids += answer["farm"]["token_ids"]
        ids += tok.encode("\n" + history[first]["content"], add_special_tokens=False)
        first += 1
    return ids + ep["answers"][-1]["farm"]["token_ids"]


def test_tool_calls_and_parse_errors_are_counted(episodes):
    """The counters rose by the calls and malformed calls the answers show: an increase over the episodes' own
    traffic, so it holds alone and in any order."""
    done, counted = episodes
    calls = sum(len(a["choices"][0]["message"].get("tool_calls") or []) for ep in done for a in ep["answers"])
    malformed = sum(len(a["farm"]["malformed_tool_calls"]) for ep in done for a in ep["answers"])
    assert calls > 200 and malformed > 20
    assert counted == {"farm_tool_calls_total": calls, "farm_tool_parse_errors_total": malformed}


def test_a_parser_that_never_matches_shows_no_tool_calls(bench_service, episodes):
    """Negative control: the same scripts read by a format with a typo in its tag count no call and no parse error,
    where hermes counted hundreds; the episodes still run (every call stays text in the content). Only this test uses
    test_wrong_tag, exported at 0 from the service's start, so its absolute 0 holds alone and in any order."""
    with ThreadPoolExecutor(10) as pool:
        done = list(pool.map(lambda seed: scripted_episode(bench_service, seed, "test_wrong_tag"), range(10)))
    for ep in done:
        assert not any(a["choices"][0]["message"].get("tool_calls") for a in ep["answers"])
        assert "<tool_call>" in ep["answers"][0]["choices"][0]["message"]["content"]
    assert metric(bench_service, "farm_tool_calls_total", format="test_wrong_tag") == 0
    assert metric(bench_service, "farm_tool_parse_errors_total", format="test_wrong_tag") == 0
    assert episodes[1]["farm_tool_calls_total"] > 200


def test_chat_turns_on_a_real_model_keep_exact_tokens_retry_and_fork(service):
    """The tiny random Llama, its role-labelled template: three chat turns, then the stored sequence scored in one
    forward pass (echo) gives back every sampled token's logprob; a retried history gets the same turn; an edited
    first message forks a segment naming its parent."""
    sid = opened(service, tool_format="plain", sampling_params={"max_new_tokens": 6, "ignore_eos": True})["session_id"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    answers = []
    for reply in ("more", "again"):
        r = chat(service, sid, {"messages": messages, "logprobs": True})
        assert r.status_code == 200, r.text
        answers.append(r.json())
        messages += [{"role": "assistant", "content": answers[-1]["choices"][0]["message"]["content"]}]
        messages += [{"role": "user", "content": reply}]
    retry = chat(service, sid, {"messages": messages[:2], "logprobs": True}).json()
    assert retry["farm"] == answers[0]["farm"] and retry["choices"] == answers[0]["choices"]
    (seg,) = trajectory(service, sid)["segments"]
    scored = httpx.post(
        f"{service}/v1/completions",
        json={"prompt": seg["token_ids"], "max_tokens": 0, "echo": True, "logprobs": 0},
        timeout=60,
    ).json()["choices"][0]["logprobs"]["token_logprobs"]
    sampled = [i for i, m in enumerate(seg["loss_mask"]) if m]
    assert len(sampled) == 12 and [seg["token_ids"][i] for i in sampled] == sum(
        (a["farm"]["token_ids"] for a in answers), []
    )
    assert [scored[i] for i in sampled] == pytest.approx([seg["logprobs"][i] for i in sampled], abs=2e-4)
    lps = [c["logprob"] for a in answers for c in a["choices"][0]["logprobs"]["content"]]
    assert lps == pytest.approx([seg["logprobs"][i] for i in sampled], abs=1e-6)
    edited = [messages[0], {"role": "user", "content": "hello"}]
    assert chat(service, sid, {"messages": edited}).status_code == 200
    first, fork = trajectory(service, sid)["segments"]
    assert (fork["parent"], fork["parent_tokens"]) == (first["segment_id"], 0)  # system and user rendered together
    rewritten = messages[:3] + [{"role": "user", "content": "something else"}]
    assert chat(service, sid, {"messages": rewritten}).status_code == 200
    *_, last = trajectory(service, sid)["segments"]  # forked from the first segment, which shares three messages
    turn0 = answers[0]["usage"]["total_tokens"]
    assert (last["parent"], last["parent_tokens"]) == (first["segment_id"], turn0)
    assert last["token_ids"][:turn0] == first["token_ids"][:turn0] and not any(last["loss_mask"][:turn0])


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]}, "tools[0]"),
        ({"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"n": 2}, "n"),
        ({"stream": True, "stream_options": {"include_usage": "sometimes"}}, "stream_options"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_chat_turns_are_refused_naming_the_field(bench_service, body, field):
    sid = opened(bench_service)["session_id"]
    r = chat(bench_service, sid, {"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 422 and field in str(r.json()), r.text
    assert trajectory(bench_service, sid)["segments"][0]["token_ids"] == []  # nothing stored


def test_a_history_ending_with_the_assistant_and_unknown_sessions_are_refused(bench_service):
    sid = opened(bench_service)["session_id"]
    r = chat(
        bench_service, sid, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}
    )
    assert r.status_code == 422 and "messages" in r.text
    first = chat(bench_service, sid, {"messages": [{"role": "user", "content": "hi say:‹yo›"}]})
    assert first.status_code == 200, first.text
    again = [{"role": "user", "content": "hi say:‹yo›"}, first.json()["choices"][0]["message"]]
    r = chat(bench_service, sid, {"messages": again})  # the stored history, answer included: nothing to answer
    assert r.status_code == 422 and "messages" in r.text, r.text
    assert chat(bench_service, "0" * 32, {"messages": [{"role": "user", "content": "hi"}]}).status_code == 404
    r = httpx.post(f"{bench_service}/v1/sessions", json={"tool_format": "xml"}, timeout=30)
    assert r.status_code == 422 and "tool_format" in r.text


def test_issue_36_session_refusals_over_http(bench_service):
    """Issue 36 items 5-7 through the real routes (the unit tests in tests/unit/test_session_turns.py name the
    mutations): a call whose arguments are not JSON is kept as sent (200, not a 500); a context overflow names the
    chat request's fields; a chat turn on a session built from token ids is a 409, not a silent fork."""
    sid = opened(bench_service)["session_id"]
    first = [{"role": "user", "content": "hi say:‹yo›"}]
    answer = chat(bench_service, sid, {"messages": first})
    assert answer.status_code == 200, answer.text
    bad_call = {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": "{oops"}}
    history = first + [
        answer.json()["choices"][0]["message"],
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": None, "tool_calls": [bad_call]},
        {"role": "tool", "tool_call_id": "c0", "content": "error say:‹ok›"},
    ]
    r = chat(bench_service, sid, {"messages": history})
    assert r.status_code == 200, r.text
    long = [{"role": "user", "content": "x" * 6000}]
    r = chat(bench_service, opened(bench_service)["session_id"], {"messages": long, "max_tokens": 4000})
    assert r.status_code == 422 and [d["field"] for d in r.json()["detail"]] == ["max_tokens"], r.text
    tokens = opened(bench_service)["session_id"]
    r = httpx.post(f"{bench_service}/v1/sessions/{tokens}/generate", json={"append_token_ids": [65, 66]}, timeout=60)
    assert r.status_code == 200, r.text
    assert chat(bench_service, tokens, {"messages": first}).status_code == 409
    assert len(trajectory(bench_service, tokens)["segments"]) == 1
