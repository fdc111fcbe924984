"""Where environments may connect: FARM_ENV_ALLOWED_HOSTS, checked after DNS, the connection pinned to the address
checked.

A request names a remote environment's URL (openenv's `url`, an MCP server's); the service would otherwise connect
wherever it says, including the Ray dashboard, Redis or a cloud's metadata address on the cluster's network. Each
pattern is `host:port`: the host a name (matched as written, case aside), an IP address (matched against what the
URL's host resolves to, so `127.1`, `2130706434` or a name that resolves there are the same address), or `*`; the
port a number or `*`. A lone `*` allows everything and must be said. Loopback is not special. The environment's
connection then goes to the resolved address that was checked, never to a second resolution of the name (no DNS
rebinding between the check and the connection); redirects to another origin are refused (rollout_farm/services/
episodes/openenv_remote.py; for the mcp SDK's HTTP client, PinnedTransport below).

The allowed hosts reach an environment through `current()`, set for each episode by rollout_farm/services/episodes/
episodes.py; outside an episode nothing is allowed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from contextvars import ContextVar
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx2

from rollout_farm.services.config.remote_environments import HOST_PATTERN

SETTING = "FARM_ENV_ALLOWED_HOSTS"
DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}


class NotAllowed(ValueError):
    """A URL whose host and port no pattern of FARM_ENV_ALLOWED_HOSTS allows (or that cannot be resolved)."""


@dataclass(frozen=True)
class Address:
    """A URL's host as written, the address it resolved to that the list allows, and its port."""

    host: str
    ip: str
    port: int

    @property
    def literal(self) -> str:
        """The IP as a URL's host (IPv6 in brackets)."""
        return f"[{self.ip}]" if ":" in self.ip else self.ip


class AllowedHosts:
    def __init__(self, patterns: list[str]):
        self.patterns = list(patterns)
        self.everything = "*" in self.patterns
        self.rules = [(m["host"].strip("[]").lower(), m["port"]) for p in self.patterns if (m := HOST_PATTERN.match(p))]

    def allows(self, host: str, ip: str, port: int) -> bool:
        """Whether a pattern allows the URL's `host` (as written) resolved to `ip`, on `port`."""
        if self.everything:
            return True
        ip = str(ipaddress.ip_address(ip.split("%", 1)[0]))  # a link-local IPv6 address comes with its %scope
        for rule_host, rule_port in self.rules:
            if rule_port != "*" and int(rule_port) != port:
                continue
            if rule_host == "*" or rule_host == host.lower() or same_ip(rule_host, ip):
                return True
        return False

    async def resolve(self, url: str) -> Address:
        """The allowed address to connect to for `url`, or NotAllowed naming the setting and what to add."""
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or DEFAULT_PORTS.get(parts.scheme, 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            raise NotAllowed(f"{host}:{port} does not resolve ({e}); {SETTING} is checked against its address")
        ips = list(dict.fromkeys(info[4][0] for info in infos))
        for ip in ips:
            if self.allows(host, ip, port):
                return Address(host, ip, port)
        listed = ", ".join(self.patterns) or "empty: no remote environment is allowed"
        raise NotAllowed(
            f"{host}:{port} (resolves to {', '.join(ips)}) is not in {SETTING} ({listed}): the deployment must list "
            f"'{host}:{port}' there for environments to connect to it"
        )


def same_ip(rule_host: str, ip: str) -> bool:
    try:
        return str(ipaddress.ip_address(rule_host)) == ip
    except ValueError:
        return False


NOTHING = AllowedHosts([])
_current: ContextVar[AllowedHosts] = ContextVar("farm_env_allowed_hosts", default=NOTHING)


def current() -> AllowedHosts:
    """The allowed hosts of the episode running in this task (nothing outside an episode)."""
    return _current.get()


def use_allowed_hosts(allowed: AllowedHosts) -> None:
    """Set the allowed hosts for this task and the tasks it starts (an episode's)."""
    _current.set(allowed)


class PinnedTransport(httpx2.AsyncBaseTransport):
    """An httpx2 transport (the mcp SDK's HTTP client) that sends every request to `at`, the address checked for
    `url`: the request keeps its URL's name in its Host header and TLS server name. A request to any other origin
    (a redirect the SDK would follow) is refused: NotAllowed, which the SDK reports as that request's error."""

    def __init__(self, url: str, at: Address):
        parts = urlsplit(url)
        self.scheme, self.at = parts.scheme, at
        self.inner = httpx2.AsyncHTTPTransport(trust_env=False)  # no proxy from the environment: the pinned address

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        port = request.url.port or DEFAULT_PORTS.get(request.url.scheme, 80)
        if (request.url.scheme, request.url.host, port) != (self.scheme, self.at.host.lower(), self.at.port):
            raise NotAllowed(f"{request.url} is not the server's origin; {SETTING} allows no redirect")
        pinned = httpx2.Request(
            request.method,
            request.url.copy_with(host=self.at.ip),
            headers=request.headers,  # its Host: the name as written
            stream=request.stream,
            extensions={**request.extensions, "sni_hostname": self.at.host},
        )
        return await self.inner.handle_async_request(pinned)

    async def aclose(self) -> None:
        await self.inner.aclose()
