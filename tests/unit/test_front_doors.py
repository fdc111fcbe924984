"""The front doors' pure conversions (rollout_farm/services/compat/anthropic.py, responses.py and their streams): a
request into a session's chat messages and tools, a chat turn's answer back into each API's shape, and the streams'
events assembled by the SDKs' own accumulators into the same answer. The service tests run them over HTTP:
tests/service/test_session_front_doors.py."""

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from rollout_farm.services.compat import anthropic as ca
from rollout_farm.services.compat import anthropic_stream, responses_stream
from rollout_farm.services.compat import responses as cr
from rollout_farm.services.errors import Invalid
from rollout_farm.services.protocol import anthropic as A
from rollout_farm.services.protocol import responses as R
from rollout_farm.services.protocol import sessions as S

CALL = {"id": "call_0_0", "type": "function", "function": {"name": "calc", "arguments": '{"x": "1+1"}'}}
FARM = {"session_id": "s1", "segment_id": "0", "turn": 2, "token_ids": [1, 2, 3], "weight_version": 0}


def answer(content, calls=(), finish="stop") -> dict:
    """A session chat turn as Sessions.chat answers it."""
    message = {"role": "assistant", "content": content, **({"tool_calls": list(calls)} if calls else {})}
    return {
        "id": "chatcmpl-s1-0-2",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else finish}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
        "farm": FARM,
    }


def anthropic_request(**body) -> A.MessagesRequest:
    return A.MessagesRequest(model="m", max_tokens=8, **body)


def test_an_anthropic_history_becomes_chat_messages():
    req = anthropic_request(
        system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "let me"},
                    {"type": "tool_use", "id": "t1", "name": "calc", "input": {"x": "1+1"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "2"}]},
                    {"type": "tool_result", "tool_use_id": "t1", "content": "boom", "is_error": True},
                    {"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
        tools=[{"name": "calc", "input_schema": {"type": "object"}}],
        tool_choice={"type": "tool", "name": "calc"},
        stop_sequences=["END"],
        top_k=5,
    )
    chat = ca.chat_request(req)
    assert [m.as_chat() for m in chat.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "let me",
            "reasoning_content": "hm",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "1+1"}'}}],
        },
        {"role": "tool", "content": "2", "tool_call_id": "t1"},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "t1"},
        {"role": "user", "content": "go on"},
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    assert chat.tool_choice.function.name == "calc"
    assert (chat.max_tokens, chat.stop, chat.top_k) == (8, ["END"], 5)


@pytest.mark.parametrize(
    "messages, extra, field",
    [
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"}]}], {}, "messages.0.content.0"),
        ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "c", "input": {}}]}], {}, "messages.0"),
        ([{"role": "user", "content": "x"}], {"tool_choice": {"type": "any"}}, "tool_choice.type"),
        (
            [{"role": "user", "content": "x"}],
            {"tools": [{"name": "f", "input_schema": {"type": 7}}]},
            "tools.0.input_schema",
        ),
        ([{"role": "user", "content": "x"}], {"tools": [{"name": "f g", "input_schema": {}}]}, "tools.0.name"),
        ([{"role": "user", "content": "x"}], {"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ],
)
def test_anthropic_requests_the_farm_cannot_honour_name_the_field(messages, extra, field):
    with pytest.raises(Invalid) as e:
        ca.chat_request(anthropic_request(messages=messages, **extra))
    assert e.value.detail[0]["field"].startswith(field), e.value.detail


def test_the_tool_use_id_refusal_names_the_block():
    """Negative control of the check: the same tool_result after the tool_use it answers is taken."""
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "c", "input": {}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}]}
    assert len(ca.chat_messages(anthropic_request(messages=[{"role": "user", "content": "x"}, use, result]))) == 3
    with pytest.raises(Invalid) as e:
        ca.chat_messages(anthropic_request(messages=[{"role": "user", "content": "x"}, result]))
    assert e.value.detail[0]["field"] == "messages.1.content.0.tool_use_id"


def test_an_answer_becomes_an_anthropic_message_and_its_stream_assembles_to_it():
    req = anthropic_request(messages=[{"role": "user", "content": "x"}])
    msg = ca.message(answer("<think>\nhm\n</think>\n\nok", [CALL]), req)
    assert msg["content"] == [
        {"type": "thinking", "thinking": "hm", "signature": ""},
        {"type": "text", "text": "ok"},
        {"type": "tool_use", "id": "call_0_0", "name": "calc", "input": {"x": "1+1"}},
    ]
    assert (msg["stop_reason"], msg["usage"], msg["farm"]["token_ids"]) == (
        "tool_use",
        {"input_tokens": 10, "output_tokens": 3},
        [1, 2, 3],
    )
    snapshot = None
    for event in anthropic_stream.stream_events(msg):
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs={})
    assert snapshot.to_dict(exclude_none=True) == {k: v for k, v in msg.items() if v is not None}


@pytest.mark.parametrize(
    "content, finish, stops, reason, stop",
    [
        ("a END b", "stop", ["END", "b"], "stop_sequence", "END"),
        ("a b", "stop", ["END"], "end_turn", None),
        ("a b", "length", None, "max_tokens", None),
    ],
)
def test_anthropic_stop_reasons(content, finish, stops, reason, stop):
    req = anthropic_request(messages=[{"role": "user", "content": "x"}], stop_sequences=stops)
    msg = ca.message(answer(content, finish=finish), req)
    assert (msg["stop_reason"], msg["stop_sequence"]) == (reason, stop)


def test_responses_input_items_become_chat_messages_after_a_previous_response():
    history = [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}]
    req = R.ResponsesRequest(
        instructions="new",
        input=[
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"type": "message", "role": "assistant", "id": "m", "content": [{"type": "output_text", "text": "ok"}]},
            {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "2"},
            {"role": "developer", "content": [{"type": "input_text", "text": "go"}]},
        ],
        tools=[{"type": "function", "name": "calc", "parameters": {"type": "object"}}],
        tool_choice="required",
        max_output_tokens=5,
    )
    chat = cr.chat_request(req, history)
    assert [m.as_chat() for m in chat.messages] == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "ok",
            "reasoning_content": "hm",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
        {"role": "system", "content": "go"},
    ]
    assert chat.tool_choice.function.name == "calc" and chat.max_completion_tokens == 5


def test_a_function_call_output_for_no_call_is_refused():
    req = R.ResponsesRequest(input=[{"type": "function_call_output", "call_id": "c9", "output": "2"}])
    with pytest.raises(Invalid) as e:
        cr.chat_request(req, [])
    assert e.value.detail[0]["field"] == "input.0.call_id"


class Segment:
    def __init__(self, id, messages, turns):
        self.id, self.messages, self.turns = id, messages, turns


class Turn:
    def __init__(self, prompt_messages):
        self.prompt_messages = prompt_messages


class Session:
    id = "s1"
    segments = [Segment("0", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], [Turn(1)])]


@pytest.mark.parametrize("rid", ["resp_s2_0_0", "resp_s1_1_0", "resp_s1_0_1", "resp_s1_0_x", "chatcmpl-s1-0-0", "x"])
def test_a_previous_response_of_another_session_or_none_is_refused(rid):
    with pytest.raises(Invalid) as e:
        cr.previous(Session(), rid)
    assert e.value.detail[0]["field"] == "previous_response_id"


def test_a_previous_response_of_the_session_gives_its_history():
    assert cr.previous(Session(), "resp_s1_0_0") == Session.segments[0].messages  # the negative control's positive


def test_a_previous_messages_text_parts_are_sent_again_as_parts():
    """A message that came as text parts is stored with them (`content_parts`, for the history match); the history a
    previous response gives back sends them as parts again: a valid session message that matches the stored one."""
    stored = [{"role": "user", "content": "ab", "content_parts": ["a", "b"]}, {"role": "assistant", "content": "c"}]

    class Parted(Session):
        segments = [Segment("0", stored, [Turn(1)])]

    (user, answer_) = cr.previous(Parted(), "resp_s1_0_0")
    assert S.SessionMessage(**user).as_chat() == stored[0] and answer_ == stored[1]


def test_an_answer_becomes_a_response_and_its_stream_assembles_to_it():
    req = R.ResponsesRequest(input="x", tools=[{"type": "function", "name": "calc"}])
    resp = cr.response(answer("<think>hm</think>ok", [CALL]), req)
    assert [o["type"] for o in resp["output"]] == ["reasoning", "message", "function_call"]
    assert resp["id"] == "resp_s1_0_2" and resp["output"][2]["call_id"] == "call_0_0"
    assert resp["output"][1]["content"][0]["text"] == "ok" and resp["farm"]["token_ids"] == [1, 2, 3]
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    events = responses_stream.stream_events(resp)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        state.handle_event(TypeAdapter(ResponseStreamEvent).validate_python(event))
    final = state._completed_response
    assert json.loads(final.to_json(exclude_none=True))["output"] == resp["output"]
    cut = cr.response(answer("par", finish="length"), req)
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


def test_free_form_json_is_checked_at_any_depth():
    """A NaN or a lone surrogate deep in a tool's schema is a 422 naming the field, as it is in a declared field (the
    answer may echo it, and no JSON holds them)."""
    for bad in (float("nan"), "\ud800"):
        with pytest.raises(ValueError, match="input_schema"):
            A.Tool(name="f", input_schema={"type": "object", "properties": {"x": {"default": [bad]}}})
    A.Tool(name="f", input_schema={"type": "object", "properties": {"x": {"default": [1.5, "ok"]}}})
