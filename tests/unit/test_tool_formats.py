"""Tool-call formats: calls read back as OpenAI tool_calls, malformed calls refused with a reason, never raised."""

import json

import pytest

from rollout_farm.services.chat.tool_formats import TOOL_FORMATS, Hermes, Plain


def test_hermes_reads_each_block_and_leaves_the_rest_as_content():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>\n'
        '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"x\\"}"}</tool_call>'
    )
    got = Hermes().parse(text, turn=3)
    assert got.content == "Let me compute."
    assert [c.openai() for c in got.calls] == [
        {
            "id": "call_3_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "37*48"}'},
        },
        {"id": "call_3_1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "x"}'}},
    ]
    assert got.malformed == []


@pytest.mark.parametrize(
    "block, reason",
    [
        ("<tool_call>{not json}</tool_call>", "not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', "not an object"),
        ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "not JSON"),
        ('<tool_call>["f"]</tool_call>', "not an object"),
        ('<tool_call>{"name": "f", "arguments": {}}', "without its </tool_call>"),
        ('<tool_call>{"name": "calcula\\u0000or", "arguments": {}}</tool_call>', "no function name"),  # sampled
        ('<tool_call>{"name": "two words", "arguments": {}}</tool_call>', "no function name"),
    ],
)
def test_a_malformed_hermes_call_is_no_call_and_says_why(block, reason):
    got = Hermes().parse(f"thinking {block}", turn=0)
    assert got.calls == [] and len(got.malformed) == 1 and reason in got.malformed[0]
    assert block in got.content  # the text is kept: the turn is an assistant message with no tool_calls


def test_plain_reads_call_lines():
    got = Plain().parse('I need a tool.\ncall calculator {"expression":"12*3"}\ncall oops\ncall f [1]', turn=1)
    assert [(c.id, c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("call_1_0", "calculator", {"expression": "12*3"})
    ]
    assert len(got.malformed) == 2 and got.content == "I need a tool.\ncall oops\ncall f [1]"


@pytest.mark.parametrize("name", ["hermes", "plain"])
def test_a_rendered_call_reads_back(name):
    fmt = TOOL_FORMATS.get(name)()
    text = "before\n" + fmt.render_call("calculator", {"expression": "7 * 6", "digits": 2})
    (call,) = fmt.parse(text, turn=0).calls
    assert (call.name, json.loads(call.arguments)) == ("calculator", {"expression": "7 * 6", "digits": 2})


def test_the_registry_names_the_formats_and_a_wrong_parser_reads_nothing():
    with pytest.raises(KeyError, match="valid names: deepseek-v3, .*, hermes, llama3-json, .*, plain, qwen3-xml"):
        TOOL_FORMATS.get("xml")
    # negative control: a parser that never matches the model's format finds 0 calls, and says nothing is malformed
    hermes_text = Hermes().render_call("calculator", {"expression": "1+1"})
    assert Plain().parse(hermes_text, turn=0).calls == []
    assert Hermes().parse(Plain().render_call("calculator", {"expression": "1+1"}), turn=0).calls == []


def test_tool_definitions_are_checked_as_json_schema_naming_the_field():
    from rollout_farm.services.chat.tool_schemas import tool_problems

    good = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    assert tool_problems([good, {"type": "function", "function": {"name": "noop"}}]) == []
    bad = [
        good,
        good,  # defined twice
        {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "string"}}},
        {"type": "function", "function": {"name": "has space"}},
        {"type": "retrieval"},
        {"type": "function", "function": {"name": "h", "parameters": {"properties": {"x": {"minimum": "zero"}}}}},
    ]
    fields = [p["field"] for p in tool_problems(bad)]
    assert fields == [
        "tools[1].function.name",
        "tools[2].function.parameters",
        "tools[3].function.parameters",
        "tools[4].function.name",
        "tools[5]",
        "tools[6].function.parameters",
    ]
    assert "not a valid JSON Schema" in tool_problems([bad[2]])[0]["message"]


def test_a_sampled_nul_reads_as_a_replacement_character_and_makes_no_call():
    """A byte-level model can sample a NUL byte: the turn's text shows it as U+FFFD (no request may carry a NUL, and
    a client sends the text back), and a call name holding it is malformed, not a call of an unknown tool."""
    from rollout_farm.services.episodes.chat_turns import parsed_turn

    got = parsed_turn(Plain(), 'ok\x00\ncall calcula\x00or {"expression":"1+1"}', 0, "auto")
    assert got.calls == [] and len(got.malformed) == 1 and "no function name" in got.malformed[0]
    assert "\x00" not in got.content and got.content == 'ok\ufffd\ncall calcula\ufffdor {"expression":"1+1"}'
