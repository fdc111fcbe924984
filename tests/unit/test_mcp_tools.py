"""MCP tools as the model sees them (rollout_farm/services/episodes/mcp_tools.py) and the `mcp` environment's params
(rollout_farm/services/episodes/mcp_env.py): pure functions, no server. The environment against real MCP servers:
tests/unit/test_mcp_env.py (in process) and tests/service/test_mcp_env.py (episodes)."""

import pytest
from pydantic import ValidationError

from rollout_farm.services.chat.tool_formats import ToolCall
from rollout_farm.services.config.settings import McpServer, ServiceSettings
from rollout_farm.services.episodes import mcp_tools
from rollout_farm.services.episodes.mcp_env import McpParams
from rollout_farm.services.episodes.mcp_tools import ToolRefused, call_arguments, openai_tools, result_text

# what tools/list answers for tests/mcp_server.py's `add`, dumped by alias as the environment reads it
ADD = {
    "name": "add",
    "title": "Add",
    "description": "Add two integers.",
    "inputSchema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
SERVERS = {"mcp_servers": {"tools": McpServer(command="python3", args=["server.py"])}}


def test_a_listed_tool_is_an_openai_function_tool():
    (tool,) = openai_tools([ADD])
    assert tool == {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers.", "parameters": ADD["inputSchema"]},
    }
    snake = {"name": "ping", "description": None, "title": "Ping", "input_schema": {"type": "object"}}  # openenv's
    assert openai_tools([snake])[0]["function"] == {
        "name": "ping",
        "description": "Ping",
        "parameters": snake["input_schema"],
    }


@pytest.mark.parametrize(
    "tool, problem",
    [
        ({**ADD, "name": "fs.read"}, "no OpenAI function name"),
        ({**ADD, "inputSchema": {"type": "string"}}, "inputSchema no function takes"),
        ({**ADD, "inputSchema": {"type": "object", "properties": 3}}, "inputSchema no function takes"),
    ],
)
def test_a_tool_no_model_can_call_is_refused_naming_it(tool, problem):
    with pytest.raises(ValueError, match=problem):
        openai_tools([tool])


def test_a_server_with_too_many_tools_is_refused():
    many = [{**ADD, "name": f"t{i}"} for i in range(mcp_tools.MAX_TOOLS + 1)]
    with pytest.raises(ValueError, match=f"lists {mcp_tools.MAX_TOOLS + 1} tools"):
        openai_tools(many)
    assert len(openai_tools(many[:-1])) == mcp_tools.MAX_TOOLS


def test_a_call_is_its_arguments_or_a_refusal_the_model_reads():
    tools = openai_tools([ADD, {**ADD, "name": "lookup"}])
    assert call_arguments(ToolCall("c", "add", '{"a": 2, "b": 3}'), tools) == {"a": 2, "b": 3}
    assert call_arguments(ToolCall("c", "add", ""), tools) == {}
    with pytest.raises(ToolRefused, match="no tool 'sub'; the tools are add, lookup"):
        call_arguments(ToolCall("c", "sub", "{}"), tools)
    with pytest.raises(ToolRefused, match="a JSON object"):
        call_arguments(ToolCall("c", "add", "[1, 2]"), tools)


def test_a_result_is_its_text_else_its_structured_content():
    text = {"content": [{"type": "text", "text": "5"}], "structuredContent": {"result": 5}, "isError": False}
    assert result_text(text) == "5"  # the text: the structured content repeats it
    assert result_text({"content": [], "structuredContent": {"result": 5, "unit": "m"}}) == '{"result":5,"unit":"m"}'
    two = {"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert result_text(two) == "a\nb"
    snake = {"content": [], "structured_content": [1, 2], "is_error": True}  # openenv's JSON of the same result
    assert result_text(snake) == "error: [1,2]"
    assert (
        result_text({"content": [{"type": "text", "text": "no entry 'x'"}], "isError": True}) == "error: no entry 'x'"
    )


def test_what_is_not_text_is_a_placeholder():
    blocks = [
        {"type": "image", "data": "AAAA" * 3, "mimeType": "image/png"},
        {"type": "resource", "resource": {"uri": "file:///a.txt", "text": "hello"}},
        {"type": "resource", "resource": {"uri": "file:///b.bin", "blob": "AA==", "mimeType": "application/zip"}},
        {"type": "resource_link", "uri": "file:///c"},
    ]
    assert result_text({"content": blocks}).split("\n") == [
        "[image image/png, 9 bytes, not shown]",
        "hello",
        "[resource file:///b.bin: application/zip, not text]",
        "[resource link file:///c]",
    ]


def test_a_long_result_is_cut_with_a_note():
    limit = mcp_tools.MAX_RESULT_CHARS
    exact = {"content": [{"type": "text", "text": "x" * limit}]}
    assert result_text(exact) == "x" * limit  # the negative control: at the bound nothing is cut
    long = {"content": [{"type": "text", "text": "x" * (limit + 5)}]}
    assert result_text(long) == "x" * limit + f"\n[truncated: the first {limit} of {limit + 5} characters]"


def test_the_params_name_a_configured_server_or_a_url():
    params = McpParams.model_validate({"server": "tools", "reward": "gsm8k"}, context=SERVERS)
    assert params._stdio == SERVERS["mcp_servers"]["tools"] and params.url is None
    assert McpParams.model_validate({"url": "http://127.0.0.1:9/mcp"}, context=SERVERS)._stdio is None
    for bad, problem in [
        ({"server": "shell"}, "unknown MCP server 'shell'; FARM_MCP_SERVERS names tools"),
        ({}, "give one of server"),
        ({"server": "tools", "url": "http://h:1/mcp"}, "give one of server"),
        ({"url": "ftp://h:1/mcp"}, "not an http\\(s\\) URL"),
        ({"server": "tools", "reward": "nope"}, "unknown reward 'nope'"),
        ({"server": "tools", "command": "sh"}, "Extra inputs are not permitted"),  # a request never names a command
    ]:
        with pytest.raises(ValidationError, match=problem):
            McpParams.model_validate(bad, context=SERVERS)
    with pytest.raises(ValidationError, match="none: the deployment configures no stdio MCP server"):
        McpParams.model_validate({"server": "tools"}, context={"mcp_servers": {}})


def test_the_servers_setting_is_named_json():
    settings = ServiceSettings(api_token="t" * 12, mcp_servers={"files": {"command": "srv", "env": {"A": "1"}}})
    assert settings.mcp_servers["files"] == McpServer(command="srv", args=[], env={"A": "1"})
    assert ServiceSettings(api_token="t" * 12).mcp_servers == {}
    with pytest.raises(ValueError, match="FARM_MCP_SERVERS: names \\['a b'\\]"):
        ServiceSettings(api_token="t" * 12, mcp_servers={"a b": {"command": "srv"}})
    with pytest.raises(ValueError, match="command"):
        ServiceSettings(api_token="t" * 12, mcp_servers={"files": {"args": []}})
