"""MCP tools against real servers, in process: the `mcp` environment (rollout_farm/services/episodes/mcp_env.py) over
stdio (tests/mcp_server.py as a subprocess, as FARM_MCP_SERVERS configures it) and over streamable HTTP (the same
server under uvicorn on 127.0.0.1), and openenv's MCP actions through the openenv adapter (an openenv-core
MCPEnvironment served by openenv's create_app). Whole episodes on the service: tests/service/test_mcp_env.py; the
allow-list's refusals, never connecting: tests/unit/test_allowed_hosts.py.
"""

import asyncio
import sys
from pathlib import Path

import pytest

from rollout_farm.services import protocol as P
from rollout_farm.services.chat.tool_formats import ToolCall
from rollout_farm.services.config.remote_environments import McpServer
from rollout_farm.services.episodes.allowed_hosts import AllowedHosts, use_allowed_hosts
from rollout_farm.services.episodes.environments import AssistantTurn
from rollout_farm.services.episodes.mcp_env import RUNNING, McpEnvironment, McpFailed, McpParams
from rollout_farm.services.episodes.openenv_remote import OpenEnvParams, OpenEnvRemote
from rollout_farm.services.net import free_port
from tests import mcp_server

SERVER = str(Path(mcp_server.__file__))
SERVERS = {
    "tools": McpServer(command=sys.executable, args=[SERVER]),
    "broken": McpServer(command=sys.executable, args=["-c", "raise SystemExit(3)"]),
    "missing": McpServer(command="/nonexistent/mcp-server"),
    "one": McpServer(command=sys.executable, args=[SERVER], max_processes=1),
    "two": McpServer(command=sys.executable, args=[SERVER], max_processes=2),
}
CALLS = [
    ToolCall("c1", "add", '{"a": 2, "b": 3}'),
    ToolCall("c2", "lookup", '{"key": "capital of France"}'),
    ToolCall("c3", "lookup", '{"key": "Atlantis"}'),
    ToolCall("c4", "sub", "{}"),
]
SEEN = [  # what the model reads of CALLS: a result, a tool error, a call no tool takes (never sent)
    ("c1", "5"),
    ("c2", "Paris"),
    ("c3", "error: Error executing tool lookup: no entry 'Atlantis'"),
    ("c4", "error: no tool 'sub'; the tools are add, lookup, shout, wait, crash"),
]


def turn(*calls: ToolCall, text: str = "") -> AssistantTurn:
    return AssistantTurn(text, [], list(calls), [], "stop")


def mcp_env(**params) -> McpEnvironment:
    return McpEnvironment(McpParams.model_validate(params, context={"mcp_servers": SERVERS}))


@pytest.fixture(scope="module")
def mcp_url():
    with mcp_server.serving(mcp_server.server.streamable_http_app(), free_port()) as url:
        yield f"{url}/mcp"


async def play(env) -> list[tuple[str, str]]:
    """Reset, CALLS, close: what the model read."""
    try:
        assert await env.reset(P.Prompt(text="Add.")) == [{"role": "user", "content": "Add."}]
        step = await env.step(turn(*CALLS))
        return [(m["tool_call_id"], m["content"]) for m in step.observation]
    finally:
        await env.close()


async def test_a_stdio_servers_tools_are_shown_and_called():
    env = mcp_env(server="tools")
    assert await play(env) == SEEN
    add = env.tools[0]["function"]
    assert (add["name"], add["description"], add["parameters"]["required"]) == ("add", "Add two integers.", ["a", "b"])
    assert env.connection.holder.done()  # closed: the SDK stopped the process


async def test_an_http_servers_tools_are_shown_and_called(mcp_url):
    use_allowed_hosts(AllowedHosts([mcp_url.split("/")[2]]))
    env = mcp_env(url=mcp_url)
    assert await play(env) == SEEN
    assert [t["function"]["name"] for t in env.tools] == ["add", "lookup", "shout", "wait", "crash"]


async def test_the_answer_ends_the_episode_scored_by_the_reward_function(mcp_url):
    use_allowed_hosts(AllowedHosts([mcp_url.split("/")[2]]))
    env = mcp_env(url=mcp_url, reward="gsm8k")
    try:
        await env.reset(P.Prompt(text="2+3?", ground_truth="5"))
        right, wrong = await env.step(turn(text="#### 5")), await env.step(turn(text="#### 6"))
        assert (right.done, right.reward, wrong.reward) == (True, 1.0, 0.0)
    finally:
        await env.close()
    unscored = mcp_env(url=mcp_url)
    assert (await unscored.step(turn(text="#### 5"))).reward == 0.0  # no reward function: 0


async def test_a_call_the_runner_cancels_is_forgotten_and_the_session_goes_on(mcp_url):
    use_allowed_hosts(AllowedHosts([mcp_url.split("/")[2]]))
    env = mcp_env(url=mcp_url)
    try:
        await env.reset(P.Prompt(text="x"))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(env.step(turn(ToolCall("w", "wait", '{"seconds": 1}'))), 0.2)
        step = await env.step(turn(ToolCall("a", "add", '{"a": 1, "b": 1}')))
        assert step.observation == [{"role": "tool", "tool_call_id": "a", "content": "2"}]
    finally:
        await env.close()


@pytest.mark.parametrize(
    "server, error",
    [
        ("broken", "mcp server 'broken' (stdio): initialize: MCPError -32000: Connection closed"),
        ("missing", "mcp server 'missing' (stdio): initialize: FileNotFoundError"),
    ],
)
async def test_a_server_that_does_not_start_fails_the_reset_naming_it(server, error):
    env = mcp_env(server=server)
    with pytest.raises(McpFailed) as failed:
        await env.reset(P.Prompt(text="x"))
    await env.close()
    assert str(failed.value).startswith(error), failed.value


async def test_a_servers_processes_are_capped_and_a_reset_that_gives_up_waiting_starts_none():
    """max_processes=1: a second episode's reset waits until the first episode's process stops; a third that gives
    up waiting (the runner's timeout) is cancelled where it waits and starts nothing. Negative control: with 2 slots
    the second episode starts at once."""
    first, second = mcp_env(server="one"), mcp_env(server="one")
    await first.reset(P.Prompt(text="Add."))
    slots = RUNNING[(asyncio.get_running_loop(), "one")]
    assert slots.locked()  # the one slot is the first episode's
    waiting = asyncio.create_task(second.reset(P.Prompt(text="Add.")))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # no slot: it cannot have started, however fast the machine
    third = mcp_env(server="one")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(third.reset(P.Prompt(text="Add.")), 0.2)
    await asyncio.wait_for(third.close(), 5)
    assert third.connection.holder.cancelled()  # never got a slot, never started a process
    await first.close()
    assert await asyncio.wait_for(waiting, 30) == [{"role": "user", "content": "Add."}]
    step = await second.step(turn(*CALLS))
    assert [(m["tool_call_id"], m["content"]) for m in step.observation] == SEEN
    await second.close()
    both = [mcp_env(server="two") for _ in range(2)]
    await asyncio.wait_for(asyncio.gather(*(e.reset(P.Prompt(text="Add.")) for e in both)), 30)
    for e in both:
        await e.close()


async def test_a_server_that_dies_mid_episode_fails_the_next_call():
    env = mcp_env(server="tools")
    try:
        await env.reset(P.Prompt(text="x"))
        with pytest.raises(McpFailed, match="mcp server 'tools' \\(stdio\\): tools/call crash: MCPError -32000: Conn"):
            await env.step(turn(ToolCall("c", "crash", "{}")))
        with pytest.raises(McpFailed, match="tools/call add: MCPError -32000: Connection closed"):  # and so on
            await env.step(turn(CALLS[0]))
    finally:
        await env.close()


@pytest.fixture(scope="module")
def openenv_mcp_url():
    """An openenv-core MCPEnvironment (its tools on fastmcp, as openenv's echo_env) served by create_app with
    CallToolAction, its action class, as openenv's MCP apps are."""
    from fastmcp import FastMCP
    from openenv.core.env_server import Observation, State, create_app
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    class Tools(MCPEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            tools = FastMCP("openenv-tools")
            tools.tool(mcp_server.add)
            tools.tool(mcp_server.lookup)
            super().__init__(tools)

        def reset(self, seed=None, episode_id=None, **kwargs):
            return Observation(done=False, reward=0.0, metadata={"ready": True})

        def _step_impl(self, action, timeout_s=None, **kwargs):
            return Observation(done=False, reward=0.0)

        @property
        def state(self):
            return State()

    with mcp_server.serving(create_app(Tools, CallToolAction, CallToolObservation), free_port()) as url:
        yield url


async def test_openenv_mcp_actions_show_its_tools_and_call_them(openenv_mcp_url):
    use_allowed_hosts(AllowedHosts([openenv_mcp_url.split("/")[2]]))
    env = OpenEnvRemote(OpenEnvParams(url=openenv_mcp_url, action="mcp"))
    try:
        assert await env.reset(P.Prompt(text="Add.")) == [{"role": "user", "content": "Add.\n{}"}]
        assert [t["function"]["name"] for t in env.tools] == ["add", "lookup"]
        assert env.tools[0]["function"]["parameters"]["required"] == ["a", "b"]
        step = await env.step(turn(*CALLS))
    finally:
        await env.close()
    assert [(m["tool_call_id"], m["content"]) for m in step.observation] == [
        ("c1", "5"),
        ("c2", "Paris"),
        ("c3", "error: Error calling tool 'lookup': no entry 'Atlantis'"),  # openenv's error, as it words it
        ("c4", "error: the environment refused the action: no tool 'sub'; the tools are add, lookup"),
    ]
