"""The openenv adapter's pure parts (rollout_farm/services/episodes/openenv_remote.py): its params, how a turn becomes
an action, how an observation is shown. The sessions against a real openenv-core server:
tests/service/test_openenv_env.py."""

import pytest
from pydantic import ValidationError

from rollout_farm.services.chat.tool_formats import ToolCall
from rollout_farm.services.chat.tool_schemas import schema_problems
from rollout_farm.services.episodes.openenv_remote import (
    OpenEnvParams,
    Refused,
    action_tool,
    call_action,
    refusal,
    shown,
    text_field,
)

# what openenv-core 0.2.1's GET /schema answers for `class GuessAction(Action): guess: int; note: str`
ACTION = {
    "additionalProperties": False,
    "description": "A guess of the number.",
    "properties": {
        "metadata": {"additionalProperties": True, "title": "Metadata", "type": "object"},
        "guess": {"title": "Guess", "type": "integer"},
        "note": {"title": "Note", "type": "string"},
    },
    "required": ["guess", "metadata"],
    "title": "GuessAction",
    "type": "object",
}


def test_the_url_is_an_http_base_url():
    assert OpenEnvParams(url="https://envs.example:8443/").url == "https://envs.example:8443"
    for bad in ["ftp://h:1", "127.0.0.1:8000", "http://", "http://h/?x=1"]:
        with pytest.raises(ValidationError, match="http\\(s\\) base URL"):
            OpenEnvParams(url=bad)
    with pytest.raises(ValidationError, match="extra"):
        OpenEnvParams(url="http://h", urll="x")
    with pytest.raises(ValidationError, match="letters, digits"):
        OpenEnvParams(url="http://h", tool_name="two words")


def test_the_text_fills_the_actions_only_string_field():
    assert text_field(ACTION) == "note"
    with pytest.raises(ValueError, match="message_field"):
        text_field({"properties": {"a": {"type": "string"}, "b": {"type": "string"}}})
    with pytest.raises(ValueError, match="message_field"):
        text_field({"properties": {"metadata": {"type": "object"}, "n": {"type": "integer"}}})


def test_the_action_tool_is_the_action_schema_without_metadata():
    tool = action_tool("act", ACTION)
    fn = tool["function"]
    assert fn["name"] == "act" and fn["description"] == "A guess of the number."
    assert set(fn["parameters"]["properties"]) == {"guess", "note"} and fn["parameters"]["required"] == ["guess"]
    assert schema_problems(fn["parameters"], "p") == []
    assert "metadata" in ACTION["properties"] and ACTION["required"] == ["guess", "metadata"]  # the schema untouched
    assert action_tool("act", {"type": "object", "title": "Move"})["function"]["description"].endswith("one Move.")


def test_a_tool_call_is_an_action_or_a_refusal():
    assert call_action(ToolCall("c1", "act", '{"guess": 3}'), "act") == {"guess": 3}
    with pytest.raises(Refused, match="the tool is act"):
        call_action(ToolCall("c1", "guess", '{"guess": 3}'), "act")
    with pytest.raises(Refused, match="JSON object"):
        call_action(ToolCall("c1", "act", "[3]"), "act")


def test_an_observation_is_shown_as_text_or_compact_json():
    obs = {"text": "say:‹hi›", "count": 2}
    assert shown(obs, None) == '{"text":"say:‹hi›","count":2}'  # not ASCII-escaped: the model reads the text
    assert shown(obs, ["text"]) == "say:‹hi›"
    assert shown(obs, ["count"]) == '{"count":2}'
    assert shown({"board": [[0, 1]]}, None) == '{"board":[[0,1]]}'


def test_a_refusal_names_the_fields():
    data = {
        "message": "Invalid message",
        "code": "VALIDATION_ERROR",
        "errors": [{"loc": ["guess"], "msg": "Field required"}, {"loc": ["gues"], "msg": "Extra inputs"}],
    }
    assert refusal(data) == "guess: Field required; gues: Extra inputs"
    assert refusal({"message": "bad"}) == "bad"
