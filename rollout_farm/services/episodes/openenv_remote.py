"""The built-in `openenv` environment: an episode against a remote openenv-core server
(github.com/meta-pytorch/OpenEnv), over the session protocol of openenv's own EnvClient.

openenv-core's HTTP `/reset` and `/step` are stateless: each call builds a fresh environment and closes it, so a step
never sees the one before. Its `/ws` keeps one environment per WebSocket connection; this adapter opens one per
episode (reset) and closes it after (close), so the remote environment keeps its state across the turns:

  -> {"type": "reset", "data": {reset kwargs}}    <- {"type": "observation", "data": {"observation", "reward", "done"}}
  -> {"type": "step", "data": {the action}}       <- the same, or {"type": "error", "data": {"message", "code"}}
  -> {"type": "close"}

A turn becomes an action: in text mode the assistant's text fills one action field; in tool mode the model is shown
one tool whose parameters are the action's JSON Schema (GET /schema), and each call's arguments are an action. In mcp
mode the environment is an openenv MCPEnvironment: the model is shown its MCP tools and each call is a CallToolAction
(openenv-core's mcp_types), as rollout_farm/services/episodes/mcp_tools.py shows any MCP server's tools:

  -> {"type": "step", "data": {"type": "list_tools"}}     <- the observation {"tools": [{name, description,
     (a ListToolsAction; a server whose action class is      input_schema}]}; a server that refuses it lists them over
     CallToolAction alone, as openenv's MCP apps are,        the session's JSON-RPC:
     refuses it)                                          -> {"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1,
                                                              "method": "tools/list"}}  <- {"type": "mcp", "data":
                                                              {"result": {"tools": [...]}}}
  -> {"type": "step", "data": {"type": "call_tool", "tool_name", "arguments"}}  <- the observation {"tool_name",
     "result": {content, structured_content, is_error} | null, "error": {"error_type", "message"} | null}, reward, done

The observation (openenv sends it without reward, done and metadata) is shown as a user or tool message. An action the
server's schema refuses (VALIDATION_ERROR) is an error the model reads; a connection refused or lost, or any other
error answer, raises naming the URL, which ends that episode with env_error. Only JSON is read from the network.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Literal
from urllib.parse import urlsplit

import httpx
import tenacity
from pydantic import BaseModel, ConfigDict, Field, field_validator
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from rollout_farm.services import protocol as P
from rollout_farm.services.chat.tool_formats import ToolCall
from rollout_farm.services.chat.tool_schemas import NAME, schema_problems
from rollout_farm.services.episodes import allowed_hosts
from rollout_farm.services.episodes.allowed_hosts import SETTING, Address, NotAllowed
from rollout_farm.services.episodes.environments import ENVIRONMENTS, AssistantTurn, Environment, Step
from rollout_farm.services.episodes.mcp_tools import ToolRefused, call_arguments, openai_tools, result_text

MAX_MESSAGE = 16 << 20  # bytes of one WebSocket message (an observation may carry an image); websockets' default: 1 MiB
OPEN_TRIES = 3  # tries of GET /schema and of opening /ws when no server answers, before the episode fails
HIDDEN = ("metadata",)  # openenv's base Action field, not for the model to set


class OpenEnvParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(..., description="The openenv server's base URL, http(s)://host:port (its /ws and /schema).")
    action: Literal["text", "tool", "mcp"] = Field(
        "text",
        description="text: the assistant's text fills message_field; tool: the model calls one tool whose parameters "
        "are the action's JSON Schema, each call an action; mcp: an MCPEnvironment, the model calls its MCP tools, "
        "each call a CallToolAction.",
    )
    message_field: str | None = Field(
        None, description="text mode: the action field the text fills; None: the action's only string field."
    )
    tool_name: str = Field("act", description="tool mode: the name of the action tool.")
    reset: dict = Field(default_factory=dict, description="The reset's kwargs (seed, episode_id, the env's own).")
    observation_fields: list[str] | None = Field(
        None,
        description="The observation fields shown to the model (None: all). One string field is shown as its "
        "text, anything else as compact JSON.",
    )

    @field_validator("url")
    @classmethod
    def http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"{url!r} is not an http(s) base URL; give e.g. http://127.0.0.1:8000")
        return url.rstrip("/")

    @field_validator("tool_name")
    @classmethod
    def tool_named(cls, name: str) -> str:
        if not NAME.match(name):
            raise ValueError(f"{name!r}: 1-64 letters, digits, '_' or '-'")
        return name


class RemoteError(RuntimeError):
    """The server could not be reached or answered with an error: the episode ends with env_error."""


class Unreachable(RemoteError):
    """No answer at all (connection refused, handshake failed): tried again before the episode fails."""


class Refused(Exception):
    """The server's action schema refused the action: the model is told, the episode goes on."""


def text_field(action_schema: dict) -> str:
    """The action's only string field (the text mode's default); ValueError naming the fields otherwise."""
    props = {k: v for k, v in action_schema.get("properties", {}).items() if k not in HIDDEN}
    strings = [k for k, v in props.items() if v.get("type") == "string"]
    if len(strings) != 1:
        raise ValueError(f"the action has fields {sorted(props)}: set env.params.message_field to the text's field")
    return strings[0]


def action_tool(name: str, action_schema: dict) -> dict:
    """The OpenAI tool whose parameters are the action's JSON Schema, without openenv's metadata field."""
    params = {**action_schema, "properties": dict(action_schema.get("properties", {}))}
    for key in HIDDEN:
        params["properties"].pop(key, None)
    if "required" in params:
        params["required"] = [k for k in params["required"] if k not in HIDDEN]
    what = action_schema.get("description") or f"Act in the environment: one {action_schema.get('title', 'action')}."
    return {"type": "function", "function": {"name": name, "description": what, "parameters": params}}


def shown(observation: dict, fields: list[str] | None) -> str:
    """The observation as the model reads it: one string field as its text, else compact JSON of the fields."""
    picked = observation if fields is None else {k: observation.get(k) for k in fields}
    if len(picked) == 1 and isinstance(only := next(iter(picked.values())), str):
        return only
    return json.dumps(picked, ensure_ascii=False, separators=(",", ":"))


def call_action(call: ToolCall, tool_name: str) -> dict:
    """A tool call's arguments as the action; Refused saying why when the call is not one."""
    if call.name != tool_name:
        raise Refused(f"no tool {call.name!r}; the tool is {tool_name}")
    args = json.loads(call.arguments or "{}")  # the tool format wrote it as JSON
    if not isinstance(args, dict):
        raise Refused("the arguments are a JSON object of the action's fields")
    return args


def tool_result(observation: dict) -> str:
    """A CallToolObservation as the model reads it: the MCP result, or `error: ` and openenv's error message."""
    error = observation.get("error")
    if isinstance(error, dict):
        return f"error: {error.get('message')}"
    result = observation.get("result")
    if isinstance(result, dict):
        return result_text(result)
    return "" if result is None else json.dumps(result, ensure_ascii=False, separators=(",", ":"))


def refusal(data: dict) -> str:
    """A VALIDATION_ERROR's errors as one line: `field: message; ...`."""
    errors = data.get("errors") or [{"msg": data.get("message", "invalid")}]
    return "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}".lstrip(": ") for e in errors)


@ENVIRONMENTS.register("openenv")
class OpenEnvRemote(Environment):
    """A remote openenv-core server (params.url), one WebSocket session (/ws) per episode: the prompt and the reset's
    observation open it, each turn is an action (its text in one field, a tool call, or a call of its MCP tools),
    reward and done are the server's. Params: url, action (text|tool|mcp), message_field, tool_name, reset,
    observation_fields."""

    Params = OpenEnvParams
    tool_format = "hermes"

    @classmethod
    def remote_urls(cls, params: OpenEnvParams) -> dict[str, str]:
        return {"url": params.url}

    def __init__(self, params: OpenEnvParams):
        super().__init__(params)
        self.where = f"openenv server {params.url}"
        self.tools: list[dict] = []  # tool mode: the action tool, known once reset has read the schema
        self.field: str | None = None  # text mode: the action field the text fills
        self.ws: ClientConnection | None = None
        self.lost: str | None = None  # why the session's state is no longer known

    async def reset(self, prompt: P.Prompt) -> list[dict]:
        if prompt.text is None:
            raise ValueError("the openenv environment takes text prompts: the instruction before the first observation")
        schema = await self.retried(self.action_schema) if self.params.action != "mcp" else {}
        if self.params.action == "tool":
            self.tools = [action_tool(self.params.tool_name, schema)]
            if problems := schema_problems(self.tools[0]["function"]["parameters"], "action"):
                raise ValueError(f"{self.where}: its action schema is no tool's parameters: {problems}")
        elif self.params.action == "text":
            self.field = self.params.message_field or text_field(schema)
            if self.field not in schema.get("properties", {}):
                raise ValueError(f"{self.where}: the action has no field {self.field!r} (env.params.message_field)")
        self.ws = await self.retried(self.open_session)
        observation, _, _ = await self.exchange({"type": "reset", "data": self.params.reset})
        if self.params.action == "mcp":
            try:
                self.tools = openai_tools(await self.mcp_tools())
            except ValueError as e:
                raise RemoteError(f"{self.where}: {e}") from None
        return [{"role": "user", "content": f"{prompt.text}\n{self.shown(observation)}"}]

    async def step(self, turn: AssistantTurn) -> Step:
        if self.params.action == "text":
            try:
                observation, reward, done = await self.exchange({"type": "step", "data": {self.field: turn.text}})
                content = self.shown(observation)
            except Refused as e:
                content, reward, done = f"error: the environment refused the action: {e}", 0.0, False
            return Step([{"role": "user", "content": content}], reward, done)
        if not turn.tool_calls:
            named = "its tools" if self.params.action == "mcp" else f"the tool {self.params.tool_name}"
            return Step([{"role": "user", "content": f"error: no call of {named}"}])
        step = Step()
        for call in turn.tool_calls:
            try:
                content, reward, step.done = await self.call(call)
            except (Refused, ToolRefused) as e:
                content, reward = f"error: the environment refused the action: {e}", 0.0
            step.observation.append({"role": "tool", "tool_call_id": call.id, "content": content})
            step.reward += reward
            if step.done:
                break
        return step

    async def call(self, call: ToolCall) -> tuple[str, float, bool]:
        """One tool call as an action: what the model reads, the reward, done."""
        if self.params.action == "tool":
            observation, reward, done = await self.exchange(
                {"type": "step", "data": call_action(call, self.params.tool_name)}
            )
            return self.shown(observation), reward, done
        action = {"type": "call_tool", "tool_name": call.name, "arguments": call_arguments(call, self.tools)}
        observation, reward, done = await self.exchange({"type": "step", "data": action})
        return tool_result(observation), reward, done

    async def mcp_tools(self) -> list[dict]:
        """The MCP tools: a ListToolsAction's observation, or the session's JSON-RPC tools/list where the server's
        action class refuses that action."""
        try:
            observation, _, _ = await self.exchange({"type": "step", "data": {"type": "list_tools"}})
            tools = observation.get("tools")
        except Refused:
            kind, data = await self.send({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}})
            if kind != "mcp" or not isinstance(data, dict) or "result" not in data:
                raise RemoteError(f"{self.where}: tools/list answered {str(data)[:200]!r}") from None
            tools = data["result"].get("tools") if isinstance(data["result"], dict) else None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RemoteError(f"{self.where}: tools/list answered no list of tools")
        return tools

    def shown(self, observation: dict) -> str:
        return shown(observation, self.params.observation_fields)

    async def close(self) -> None:
        if self.ws is None:
            return
        try:
            await self.ws.send(json.dumps({"type": "close"}))
        except ConnectionClosed:
            pass
        await self.ws.close()

    async def retried(self, opening: Callable[[], Awaitable]):
        """What `opening` answers; one that finds no server is tried OPEN_TRIES times, with capped backoff."""
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(Unreachable),
            wait=tenacity.wait_random_exponential(multiplier=0.2, max=2.0),
            stop=tenacity.stop_after_attempt(OPEN_TRIES),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await opening()

    async def address(self) -> Address:
        """Where the server is: the address FARM_ENV_ALLOWED_HOSTS allows for its URL, resolved once."""
        try:
            return await allowed_hosts.current().resolve(self.params.url)
        except NotAllowed as e:
            raise RemoteError(f"{self.where}: {e}") from None

    async def action_schema(self) -> dict:
        """The action's JSON Schema, from GET /schema (to the checked address; a redirect is not followed)."""
        at = await self.address()
        parts = urlsplit(self.params.url)
        pinned = f"{parts.scheme}://{at.literal}:{at.port}{parts.path}/schema"
        try:
            async with httpx.AsyncClient(timeout=None, follow_redirects=False) as http:  # the runner bounds the call
                r = await http.get(pinned, headers={"Host": parts.netloc}, extensions={"sni_hostname": at.host})
        except httpx.TransportError as e:
            raise Unreachable(f"{self.where}: GET /schema: {type(e).__name__}: {e}") from None
        try:
            r.raise_for_status()
            schema = r.json()["action"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            raise RemoteError(f"{self.where}: GET /schema: {type(e).__name__}: {e}") from None
        if not isinstance(schema, dict):
            raise RemoteError(f"{self.where}: GET /schema answered no action schema")
        return schema

    async def open_session(self) -> ClientConnection:
        """The episode's WebSocket session (/ws): one remote environment, kept until close. The connection goes to
        the checked address (`host`, `port`: websockets then refuses a redirect to another origin)."""
        ws_url = "ws" + self.params.url.removeprefix("http") + "/ws"  # http -> ws, https -> wss
        at = await self.address()
        try:  # the runner bounds the call
            return await connect(ws_url, host=at.ip, port=at.port, open_timeout=None, max_size=MAX_MESSAGE)
        except ValueError as e:  # websockets: a redirect to another origin while host and port are pinned
            raise RemoteError(
                f"{self.where}: {ws_url} redirected elsewhere ({e}); {SETTING} allows no redirect"
            ) from None
        except (OSError, InvalidHandshake) as e:
            raise Unreachable(f"{self.where}: cannot open {ws_url}: {type(e).__name__}: {e}") from None

    async def exchange(self, message: dict) -> tuple[dict, float, bool]:
        """One message and its answer: the observation, the reward, done. Refused for an action the schema refuses;
        RemoteError for anything else that is not an observation."""
        kind, data = await self.send(message)
        if kind == "error" and isinstance(data, dict):
            if message["type"] == "step" and data.get("code") == "VALIDATION_ERROR":
                raise Refused(refusal(data))
            raise RemoteError(f"{self.where}: {message['type']}: {data.get('code')}: {data.get('message')}")
        if kind != "observation" or not isinstance(data, dict) or not isinstance(data.get("observation"), dict):
            raise RemoteError(f"{self.where}: {message['type']} answered {str(data)[:200]!r}, not an observation")
        return data["observation"], float(data.get("reward") or 0), bool(data.get("done"))

    async def send(self, message: dict) -> tuple[str | None, object]:
        """One message and its answer's type and data; RemoteError when the session is lost or answers no JSON."""
        if self.lost:
            raise RemoteError(f"{self.where}: {self.lost}")
        try:
            await self.ws.send(json.dumps(message))
            reply = json.loads(await self.ws.recv())
        except asyncio.CancelledError:  # the runner's timeout: the answer may still come, to the wrong question
            self.lost = f"an earlier {message['type']} did not answer in time; the session's state is unknown"
            raise
        except ConnectionClosed as e:
            raise RemoteError(f"{self.where}: the session closed: {e}") from None
        except ValueError as e:
            raise RemoteError(f"{self.where}: an answer that is not JSON: {e}") from None
        return (reply.get("type"), reply.get("data")) if isinstance(reply, dict) else (None, reply)
