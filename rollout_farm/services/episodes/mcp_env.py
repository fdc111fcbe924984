"""The built-in `mcp` environment: an MCP server's tools, shown to the model as function tools and called for it
(the `mcp` package's client: ClientSession over stdio or streamable HTTP), one MCP session per episode.

Where the server is comes from one of two params, never from a command in the request (that would let a caller run
any program on the service):
  server   a stdio server the deployment configured, by name (FARM_MCP_SERVERS: command, args, env, cwd); each
           episode starts its own process and stops it at the end (the SDK closes its stdin, then terminates it)
  url      a streamable HTTP endpoint, checked like openenv's: its host:port in FARM_ENV_ALLOWED_HOSTS after DNS
           (a 422 before the episode), the connection pinned to the address checked, another origin refused
           (rollout_farm/services/episodes/allowed_hosts.py, PinnedTransport)

reset opens the session (initialize, tools/list: the tools, rollout_farm/services/episodes/mcp_tools.py) and shows
the prompt; each turn's tool calls are `tools/call`s, their results the tool messages (a result the tool marks as an
error is one the model reads); the turn that calls no tool is the answer and ends the episode. MCP has no reward:
`reward` names a reward function (REWARDS, as the calculator's) of the answer against the prompt's ground_truth;
without one the reward is 0 and the client scores the trajectory itself. A server that does not start, a JSON-RPC
error or a lost session raises naming the server, which ends that episode with env_error; the runner bounds each
step by the request's tool_timeout_s (a call it cancels is forgotten: the session goes on).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx2
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client, types
from mcp.client.streamable_http import streamable_http_client
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from rollout_farm.services import protocol as P
from rollout_farm.services.config.remote_environments import McpServer
from rollout_farm.services.episodes import allowed_hosts
from rollout_farm.services.episodes.allowed_hosts import Address, NotAllowed, PinnedTransport
from rollout_farm.services.episodes.environments import ENVIRONMENTS, AssistantTurn, Environment, Step
from rollout_farm.services.episodes.mcp_tools import MAX_TOOLS, ToolRefused, call_arguments, openai_tools, result_text
from rollout_farm.services.extensions.rewards import REWARDS

SERVERS_SETTING = "FARM_MCP_SERVERS"
HTTP_TIMEOUT = httpx2.Timeout(30.0, read=300.0)  # the SDK's; the runner's tool_timeout_s bounds each step anyway
T = TypeVar("T")


class McpParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    server: str | None = Field(
        None, description="A stdio MCP server of the deployment's FARM_MCP_SERVERS, by name (or give url)."
    )
    url: str | None = Field(
        None,
        description="A streamable HTTP MCP endpoint, http(s)://host:port/path (e.g. .../mcp); its host:port must be "
        "in FARM_ENV_ALLOWED_HOSTS (or give server).",
    )
    reward: str | None = Field(
        None,
        description="The reward function (REWARDS) of the answer (the turn that calls no tool) against the prompt's "
        "ground_truth; None: reward 0 (MCP has none: score the trajectory yourself).",
    )
    _stdio: McpServer | None = PrivateAttr(None)  # the configured server `server` names

    @field_validator("server")
    @classmethod
    def configured(cls, name: str | None, info: ValidationInfo) -> str | None:
        servers = (info.context or {}).get("mcp_servers", {})
        if name is not None and name not in servers:
            listed = ", ".join(sorted(servers)) or "none: the deployment configures no stdio MCP server"
            raise ValueError(f"unknown MCP server {name!r}; {SERVERS_SETTING} names {listed}")
        return name

    @field_validator("url")
    @classmethod
    def http_url(cls, url: str | None) -> str | None:
        parts = urlsplit(url) if url is not None else None
        if parts is not None and (parts.scheme not in ("http", "https") or not parts.hostname or parts.fragment):
            raise ValueError(f"{url!r} is not an http(s) URL; give the MCP endpoint, e.g. http://127.0.0.1:8000/mcp")
        return url

    @field_validator("reward")
    @classmethod
    def registered(cls, name: str | None) -> str | None:
        if name is not None and name not in REWARDS.names():
            raise ValueError(f"unknown reward {name!r}: {', '.join(REWARDS.names())}")
        return name

    @model_validator(mode="after")
    def one_server(self, info: ValidationInfo) -> McpParams:
        if (self.server is None) == (self.url is None):
            raise ValueError("give one of server (a stdio server of FARM_MCP_SERVERS) and url (streamable HTTP)")
        if self.server is not None:
            self._stdio = (info.context or {})["mcp_servers"][self.server]
        return self


class McpFailed(RuntimeError):
    """The server did not start, answered a JSON-RPC error, or the session ended: the episode ends with env_error."""


class McpConnection:
    """One MCP client session, held open from open() to close() by a task of its own: anyio's scopes (the SDK's
    transports and ClientSession) must be left in the task that entered them, and the runner calls reset, step and
    close from different tasks. A request races the holder, so a session that ends fails the request at once."""

    def __init__(self, where: str, transport: Callable[[], AbstractAsyncContextManager]):
        self.where, self.transport = where, transport
        self.closing = asyncio.Event()
        self.holder: asyncio.Task | None = None
        self.opened: asyncio.Future[ClientSession] | None = None

    async def open(self) -> ClientSession:
        self.opened = asyncio.get_running_loop().create_future()
        self.holder = asyncio.create_task(self.hold(self.opened))
        return await self.request("initialize", self.opened)

    async def hold(self, opened: asyncio.Future) -> None:
        async with self.transport() as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            if not opened.done():  # else the reset gave up waiting (the runner's timeout), and close comes next
                opened.set_result(session)
            await self.closing.wait()

    async def request(self, what: str, pending: Awaitable[T]) -> T:
        """What `pending` answers; McpFailed naming the server when it raises or the session ends first."""
        task = asyncio.ensure_future(pending)
        try:
            done, _ = await asyncio.wait({task, self.holder}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the runner's timeout: the call is forgotten, the session goes on
            task.cancel()
            raise
        if task not in done:
            task.cancel()
            raise McpFailed(f"{self.where}: {what}: {ending(self.holder)}")
        try:
            return task.result()
        except Exception as e:
            raise McpFailed(f"{self.where}: {what}: {described(e)}") from None

    async def close(self) -> None:
        """The session closed: the SDK's shutdown (stdin closed, then the process stopped, all bounded); one that never
        opened (the reset gave up while it waited for a process slot or started) is cancelled where it is."""
        self.closing.set()
        if self.holder is None:
            return
        if not (self.opened.done() and not self.opened.cancelled()):
            self.holder.cancel()
        await asyncio.wait({self.holder})  # its error, if any, was reported by the request it failed


def described(e: BaseException) -> str:
    """An error as one line: the first leaf of an exception group, a JSON-RPC error's code and message."""
    while getattr(e, "exceptions", None):  # an exception group (a builtin from Python 3.11, anyio's backport before)
        e = e.exceptions[0]
    if isinstance(e, MCPError):
        return f"MCPError {e.code}: {e.message}"
    return f"{type(e).__name__}: {e}"


def ending(holder: asyncio.Task) -> str:
    """Why the session ended: the error that ended it (the server not starting, a transport's failure)."""
    if holder.cancelled():
        return "the session was cancelled"
    return described(holder.exception()) if holder.exception() else "the session ended"


RUNNING: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Semaphore] = {}  # a stdio server's process slots


@asynccontextmanager
async def one_of(name: str, limit: int, process: AbstractAsyncContextManager) -> AsyncIterator[Any]:
    """The server's process, started once one of its `limit` slots in this event loop is free (McpServer.max_processes);
    the slot is given back when the process stops."""
    slots = RUNNING.setdefault((asyncio.get_running_loop(), name), asyncio.Semaphore(limit))
    async with slots, process as streams:
        yield streams


@asynccontextmanager
async def pinned_http(url: str, at: Address) -> AsyncIterator[Any]:
    """The SDK's streamable HTTP transport, its HTTP client sending every request to the checked address."""
    async with (
        httpx2.AsyncClient(transport=PinnedTransport(url, at), timeout=HTTP_TIMEOUT) as http,
        streamable_http_client(url, http_client=http) as streams,
    ):
        yield streams


@ENVIRONMENTS.register("mcp")
class McpEnvironment(Environment):
    """An MCP server's tools (a stdio server of FARM_MCP_SERVERS by name, or a streamable HTTP url in
    FARM_ENV_ALLOWED_HOSTS), one MCP session per episode: the model's tool calls are tools/call, their results the
    observations; the turn that calls no tool ends it, scored by `reward` (REWARDS) or 0. Params: server | url,
    reward."""

    Params = McpParams
    tool_format = "hermes"

    @classmethod
    def remote_urls(cls, params: McpParams) -> dict[str, str]:
        return {"url": params.url} if params.url is not None else {}

    def __init__(self, params: McpParams):
        super().__init__(params)
        self.where = f"mcp server {params.server!r} (stdio)" if params.server else f"mcp server {params.url}"
        self.tools: list[dict] = []  # the server's, once reset has listed them
        self.reward = REWARDS.get(params.reward) if params.reward else None
        self.ground_truth: str | None = None
        self.connection: McpConnection | None = None
        self.session: ClientSession | None = None

    async def reset(self, prompt: P.Prompt) -> list[dict]:
        if prompt.text is None:
            raise ValueError("the mcp environment takes text prompts")
        self.ground_truth = prompt.ground_truth
        self.connection = McpConnection(self.where, await self.transport())
        self.session = await self.connection.open()
        listed = await self.listed_tools()
        try:
            self.tools = openai_tools(listed)
        except ValueError as e:
            raise McpFailed(f"{self.where}: {e}") from None
        return [{"role": "user", "content": prompt.text}]

    async def transport(self) -> Callable[[], AbstractAsyncContextManager]:
        """How to open the server: its configured process, or its URL at the address the allow-list checked."""
        stdio = self.params._stdio
        if stdio is not None:
            server = StdioServerParameters(command=stdio.command, args=stdio.args, env=stdio.env, cwd=stdio.cwd)
            return lambda: one_of(self.params.server, stdio.max_processes, stdio_client(server))
        try:
            at = await allowed_hosts.current().resolve(self.params.url)
        except NotAllowed as e:
            raise McpFailed(f"{self.where}: {e}") from None
        return lambda: pinned_http(self.params.url, at)

    async def listed_tools(self) -> list[dict]:
        """Every tool of tools/list, its pages followed: at most MAX_TOOLS + 1 pages, and no page once more tools than
        the model is shown came (openai_tools refuses them), so a server that pages on forever ends."""
        tools, cursor = [], None
        for _ in range(MAX_TOOLS + 1):
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await self.connection.request("tools/list", self.session.list_tools(params=params))
            tools += [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in page.tools]
            cursor = page.next_cursor
            if not cursor or len(tools) > MAX_TOOLS:
                return tools
        raise McpFailed(f"{self.where}: tools/list gave more than {MAX_TOOLS + 1} pages")

    async def step(self, turn: AssistantTurn) -> Step:
        if not turn.tool_calls:
            return Step(reward=self.reward(turn.text, self.ground_truth) if self.reward else 0.0, done=True)
        step = Step()
        for call in turn.tool_calls:
            try:
                args = call_arguments(call, self.tools)
            except ToolRefused as e:
                content = f"error: {e}"
            else:
                calling = self.session.call_tool(call.name, args)
                result = await self.connection.request(f"tools/call {call.name}", calling)
                content = result_text(result.model_dump(mode="json", by_alias=True))
            step.observation.append({"role": "tool", "tool_call_id": call.id, "content": content})
        return step

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()
