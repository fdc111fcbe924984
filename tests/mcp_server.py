"""A small MCP server for the `mcp` environment's tests (rollout_farm/services/episodes/mcp_env.py), built on the `mcp`
package's own MCPServer: `add` (a structured result), `lookup` (a table; an unknown key is a tool error), `shout`
(a result longer than the environment shows), `wait` (a call slower than a step's timeout) and `crash` (the server
process exits mid-call).

    python tests/mcp_server.py            # over stdio: the service starts it (FARM_MCP_SERVERS)
    python tests/mcp_server.py PORT       # streamable HTTP on 127.0.0.1:PORT, at /mcp

In a test, serving(server.streamable_http_app(), port) runs an ASGI app (this one over HTTP, an openenv app) under
uvicorn in a thread.

The table scripts the bench app's EchoEngine (tests/farm_plugins.py), which says the last `say:‹...›` of its prompt:
a tool result that holds one is the model's next turn.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

TABLE = {"answer": "say:‹#### 5›", "capital of France": "Paris"}

server = MCPServer("farm-test-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def lookup(key: str) -> str:
    """The table's entry for a key."""
    if key not in TABLE:
        raise ToolError(f"no entry {key!r}")  # a tool error the model reads
    return TABLE[key]


@server.tool()
def shout(text: str, times: int) -> str:
    """The text, repeated."""
    return text * times


@server.tool()
def wait(seconds: float) -> str:
    """Answer after a while."""
    time.sleep(seconds)
    return "waited"


@server.tool()
def crash() -> str:
    """Exit the server process."""
    os._exit(3)


@contextmanager
def serving(app, port: int):
    """`app` under uvicorn on 127.0.0.1:`port`, in a thread, until the block ends."""
    import uvicorn

    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(timeout=10)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
    else:
        server.run("stdio")
