"""The settings of remote environments: FARM_ENV_ALLOWED_HOSTS's host:port patterns and FARM_MCP_SERVERS's entries,
each checked at start-up (rollout_farm/services/config/settings.py reads them; the episodes use them)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

HOST_PATTERN = re.compile(r"^(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>\*|\d{1,5})$")


def pattern_problem(pattern: str) -> str | None:
    """Why `pattern` is no FARM_ENV_ALLOWED_HOSTS entry (rollout_farm/services/episodes/allowed_hosts.py), or None."""
    if pattern == "*":
        return None
    found = HOST_PATTERN.match(pattern)
    if not found:
        return f"{pattern!r} is not host:port (a name, an IP address or *, then a port or *; [v6 address]:port)"
    if found["port"] != "*" and not 0 < int(found["port"]) < 65536:
        return f"{pattern!r}: port {found['port']} is out of range"
    return None


MCP_SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class McpServer(BaseModel):
    """A stdio MCP server the deployment lets episodes start (FARM_MCP_SERVERS): a request names it, never a command."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    command: str = Field(..., min_length=1, description="The executable: a path, or a name on the service's PATH.")
    args: list[str] = Field(default_factory=list, description="Its arguments.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Its environment variables, over the few the mcp SDK passes on (HOME, PATH, SHELL, TERM, USER, "
        "LOGNAME): the service's own (its token, Redis) are not.",
    )
    cwd: str | None = Field(None, description="Its working folder; None: the service's.")
    max_processes: int = Field(
        16,
        ge=1,
        le=1024,
        description="Its processes running at once in one ingress replica (one per episode): an episode beyond waits "
        "for one to stop, within its reset's timeout (`env_timeout_s`), so a request's prompts times n cannot start "
        "a process each at once.",
    )
