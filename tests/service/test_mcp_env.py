"""The built-in `mcp` environment (rollout_farm/services/episodes/mcp_env.py) in episodes on the real service: an MCP
server's tools called by the model, over stdio (tests/mcp_server.py, started by the service from the bench app's
FARM_MCP_SERVERS) and over streamable HTTP (the same server under uvicorn on the port the bench app's
FARM_ENV_ALLOWED_HOSTS lists).

The model is the bench app's EchoEngine, the scripted agent model (tests/farm_plugins.py): it says the last
`say:‹...›` of its prompt, so the prompt makes it call `add` and `lookup`, and lookup's answer (`say:‹#### 5›`)
makes it answer.
"""

import socket

import httpx
import pytest

from rollout_farm.services.models import byte_tokenizer
from rollout_farm.services.net import free_port
from tests import mcp_server

PARAMS = {"max_new_tokens": 256, "temperature": 0.0}  # two hermes calls of the byte tokenizer
CALLS = (
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    '<tool_call>{"name": "lookup", "arguments": {"key": "answer"}}</tool_call>'
)
PROMPT = {"text": f"2+3? say:‹{CALLS}›", "ground_truth": "5"}


@pytest.fixture(scope="module")
def mcp_url(env_ports):
    with mcp_server.serving(mcp_server.server.streamable_http_app(), env_ports["mcp"]) as url:
        yield f"{url}/mcp"


def post(bench: str, params: dict, **body) -> httpx.Response:
    req = {"env": {"name": "mcp", "params": params}, "prompts": [PROMPT], "sampling_params": PARAMS, "max_turns": 3}
    return httpx.post(f"{bench}/v1/episodes", json={**req, **body}, timeout=120)


def episodes(bench: str, params: dict, **body) -> list[dict]:
    r = post(bench, params, **body)
    assert r.status_code == 200, r.text
    (group,) = r.json()["groups"]
    return group["episodes"]


def assert_tools_called(ep: dict) -> None:
    """The calls, the server's results in the observation, then the answer the last result scripted, scored."""
    assert (ep["stop_reason"], ep["error"], ep["tool_calls"], ep["turn_rewards"]) == ("done", None, 2, [0.0, 1.0])
    (seg,) = ep["segments"]
    pieces = [(PROMPT["text"], 0), (CALLS, 1), ("\n5\nsay:‹#### 5›", 0), ("#### 5", 1)]  # add's 5, lookup's entry
    assert byte_tokenizer().decode(seg["token_ids"]) == "".join(text for text, _ in pieces)
    assert seg["loss_mask"] == [m for text, m in pieces for _ in text.encode()]  # the byte tokenizer: a byte each


def test_a_stdio_servers_tools_are_called_in_episodes(bench_service):
    for ep in episodes(bench_service, {"server": "tools", "reward": "gsm8k"}, n=2):  # a server process each
        assert_tools_called(ep)


def test_an_http_servers_tools_are_called_in_episodes(bench_service, mcp_url):
    for ep in episodes(bench_service, {"url": mcp_url, "reward": "gsm8k"}, n=2):
        assert_tools_called(ep)
    (unscored,) = episodes(bench_service, {"url": mcp_url})
    assert unscored["turn_rewards"] == [0.0, 0.0]  # no reward function: MCP has no reward


def test_a_server_that_does_not_start_ends_the_episode_with_env_error_and_the_next_works(bench_service):
    for ep in episodes(bench_service, {"server": "broken"}, n=2):
        assert (ep["stop_reason"], ep["turns"]) == ("env_error", 0)
        assert (
            ep["error"]
            == "reset: McpFailed: mcp server 'broken' (stdio): initialize: MCPError -32000: Connection closed"
        )
    (ep,) = episodes(bench_service, {"server": "tools", "reward": "gsm8k"})
    assert_tools_called(ep)


def test_an_mcp_url_not_listed_is_a_422_naming_it_before_any_connection(bench_service, env_ports):
    with socket.create_server(("127.0.0.2", free_port("127.0.0.2"))) as hidden:
        hidden.setblocking(False)
        for url in (f"http://127.0.0.2:{hidden.getsockname()[1]}/mcp", f"http://127.0.0.2:{env_ports['mcp']}/mcp"):
            r = post(bench_service, {"url": url})
            assert r.status_code == 422, r.text
            (problem,) = r.json()["detail"]
            assert problem["field"] == "env.params.url" and "is not in FARM_ENV_ALLOWED_HOSTS" in problem["message"]
        with pytest.raises(BlockingIOError):  # no connection waits to be accepted: none was made
            hidden.accept()


def test_an_unknown_stdio_server_is_a_422_listing_the_names(bench_service):
    for params, field, message in [
        ({"server": "shell"}, "env.params.server", "unknown MCP server 'shell'; FARM_MCP_SERVERS names broken, tools"),
        ({"server": "tools", "command": "sh"}, "env.params.command", "Extra inputs are not permitted"),
    ]:
        r = post(bench_service, params)
        assert r.status_code == 422, r.text
        assert {"field": field, "message": message} in [
            {"field": p["field"], "message": p["message"].removeprefix("Value error, ")} for p in r.json()["detail"]
        ], r.text
    listed = httpx.get(f"{bench_service}/v1/environments", timeout=30).json()
    assert "MCP server" in listed["environments"]["mcp"]
    assert {"server", "url", "reward"} == set(listed["params"]["mcp"]["properties"])
