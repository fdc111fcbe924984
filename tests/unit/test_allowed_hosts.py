"""FARM_ENV_ALLOWED_HOSTS (rollout_farm/services/episodes/allowed_hosts.py): where a remote environment may connect.

Real sockets on loopback: a listener on 127.0.0.2 that the list does not allow counts every connection made to it, and
must count none: named by its address, by another spelling of it (`127.2`, `2130706434`: the resolver's forms, as a
hostname that resolves there), and behind a redirect from an allowed server (HTTP and WebSocket; openenv's and an
MCP server's over streamable HTTP). The allowed server itself answers.
"""

import asyncio
import json
from http import HTTPStatus

import httpx2
import pytest

from rollout_farm.services import protocol as P
from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.episodes import allowed_hosts
from rollout_farm.services.episodes.allowed_hosts import (
    Address,
    AllowedHosts,
    NotAllowed,
    PinnedTransport,
    use_allowed_hosts,
)
from rollout_farm.services.episodes.mcp_env import McpEnvironment, McpFailed, McpParams
from rollout_farm.services.episodes.openenv_remote import OpenEnvParams, OpenEnvRemote, RemoteError
from rollout_farm.services.net import free_port

SCHEMA = {"action": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}}


class Listener:
    """A TCP server that counts connections and answers each request with `answer(path)` (status, headers, body)."""

    def __init__(self, host: str, answer):
        self.host, self.answer, self.connections, self.port = host, answer, 0, free_port(host)
        self.heads: list[bytes] = []  # each request's line and headers

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.serve, self.host, self.port)
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    async def serve(self, reader, writer):
        self.connections += 1
        request = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(request)
        path = request.split(b" ", 2)[1].decode()
        status, headers, body = self.answer(path)
        head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
        writer.write((head + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode() + body)
        await writer.drain()
        writer.close()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def forbidden(path):
    return 200, {"Content-Type": "application/json"}, json.dumps(SCHEMA).encode()


@pytest.mark.parametrize(
    "patterns, problem",
    [(["127.0.0.1"], "is not host:port"), (["host:99999"], "out of range"), (["a b:1"], "is not host:port")],
)
def test_a_pattern_that_is_no_host_and_port_fails_at_start_up_naming_the_setting(patterns, problem):
    with pytest.raises(ValueError, match=f"FARM_ENV_ALLOWED_HOSTS: .*{problem}"):
        ServiceSettings(api_token="t" * 12, env_allowed_hosts=patterns)
    assert ServiceSettings(api_token="t" * 12).env_allowed_hosts == []  # the default: nothing allowed


def test_names_addresses_and_wildcards():
    allowed = AllowedHosts(["envs.internal:8000", "10.0.3.7:*", "*:9000", "[::1]:7000"])
    assert allowed.allows("envs.internal", "10.9.9.9", 8000) and not allowed.allows("envs.internal", "10.9.9.9", 8001)
    assert allowed.allows("anything", "10.0.3.7", 1234)  # an address pattern: what the name resolved to
    assert allowed.allows("other", "192.0.2.1", 9000) and allowed.allows("x", "::1", 7000)
    assert not allowed.allows("x", "fe80::1%eth0", 7000)  # a scoped link-local address (getaddrinfo's form) reads
    assert not allowed.allows("localhost", "127.0.0.1", 8265)  # loopback is not special: the Ray dashboard
    assert AllowedHosts(["*"]).allows("any", "169.254.169.254", 80) and not AllowedHosts([]).allows("a", "1.1.1.1", 80)


async def test_an_address_not_listed_is_never_connected_to_however_it_is_spelled():
    async with Listener("127.0.0.2", forbidden) as hidden:
        allowed = AllowedHosts([f"127.0.0.1:{hidden.port}"])  # the same port on another address
        for host in ("127.0.0.2", "127.2", "2130706434"):  # the address, and names the resolver turns into it
            url = f"http://{host}:{hidden.port}"
            with pytest.raises(NotAllowed, match=rf"{host}:{hidden.port} \(resolves to 127.0.0.2\) is not in FARM_E"):
                await allowed.resolve(url)
            use_allowed_hosts(allowed)
            env = OpenEnvRemote(OpenEnvParams(url=url))
            with pytest.raises(RemoteError, match="FARM_ENV_ALLOWED_HOSTS"):
                await env.action_schema()
            with pytest.raises(RemoteError, match="FARM_ENV_ALLOWED_HOSTS"):
                await env.open_session()
        assert hidden.connections == 0


async def test_a_redirect_from_an_allowed_server_to_one_not_listed_is_not_followed():
    async with Listener("127.0.0.2", forbidden) as hidden:

        def elsewhere(path):
            return 302, {"Location": hidden.url.replace("http", "ws" if path == "/ws" else "http") + path}, b""

        async with Listener("127.0.0.1", elsewhere) as redirecting:
            use_allowed_hosts(AllowedHosts([f"127.0.0.1:{redirecting.port}"]))
            env = OpenEnvRemote(OpenEnvParams(url=redirecting.url))
            with pytest.raises(RemoteError, match="GET /schema"):
                await env.action_schema()
            with pytest.raises(RemoteError, match="redirected elsewhere"):
                await env.open_session()
            assert redirecting.connections == 2 and hidden.connections == 0


async def test_an_allowed_server_answers_and_outside_an_episode_nothing_is_allowed():
    async with Listener("127.0.0.1", forbidden) as server:
        env = OpenEnvRemote(OpenEnvParams(url=server.url))
        assert allowed_hosts.current().patterns == []  # outside an episode: nothing
        with pytest.raises(RemoteError, match="empty: no remote environment is allowed"):
            await env.action_schema()
        assert server.connections == 0
        use_allowed_hosts(AllowedHosts([f"127.0.0.1:{server.port}"]))
        assert await env.action_schema() == SCHEMA["action"]
        assert server.connections == 1


async def test_an_mcp_server_not_listed_or_behind_a_redirect_is_never_connected_to():
    """MCP over streamable HTTP obeys the same list: the `mcp` environment's URL is resolved and checked before any
    connection, and the SDK's client, pinned to the checked address, follows no redirect to another origin."""
    async with Listener("127.0.0.2", forbidden) as hidden:

        def elsewhere(path):
            return 307, {"Location": f"{hidden.url}/mcp"}, b""

        async with Listener("127.0.0.1", elsewhere) as redirecting:
            for url, allowed, error in [
                (f"{hidden.url}/mcp", [f"127.0.0.1:{hidden.port}"], "is not in FARM_ENV_ALLOWED_HOSTS"),
                (f"{redirecting.url}/mcp", [f"127.0.0.1:{redirecting.port}"], "initialize: MCPError -32600: Redirect"),
            ]:
                use_allowed_hosts(AllowedHosts(allowed))
                env = McpEnvironment(McpParams(url=url))
                with pytest.raises(McpFailed, match=error):
                    await env.reset(P.Prompt(text="x"))
                await env.close()
            assert redirecting.connections == 1 and hidden.connections == 0


async def test_the_mcp_client_goes_to_the_checked_address_with_the_name_as_host():
    """PinnedTransport: a request for the URL's name goes to the address checked (not to a second resolution of the
    name), its Host header the name; a request for any other origin is refused unsent."""
    async with Listener("127.0.0.1", forbidden) as server:
        url = f"http://mcp.invalid:{server.port}/mcp"  # .invalid never resolves: only the pin can reach the server
        transport = PinnedTransport(url, Address("mcp.invalid", "127.0.0.1", server.port))
        async with httpx2.AsyncClient(transport=transport) as http:
            assert (await http.get(url)).json() == SCHEMA
            for other in (f"http://127.0.0.1:{server.port}/mcp", f"https://mcp.invalid:{server.port}/mcp"):
                with pytest.raises(NotAllowed, match="allows no redirect"):
                    await http.get(other)
        assert server.connections == 1 and f"Host: mcp.invalid:{server.port}".encode() in server.heads[0]
