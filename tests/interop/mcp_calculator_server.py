"""A tiny MCP server over stdio for the MCP tool tests (``python mcp_calculator_server.py [--no-tools]``), written
with the mcp package's ``MCPServer``: ``multiply`` (the calculator task's tool), ``fail`` (answers with an error
result), ``nap`` (sleeps, to overrun a timeout), ``spawn`` (starts a ``sleep 600`` child, answers its process id),
``whoami`` (this process's id and its calls so far: a server-side counter that tells one long-lived server from a
server per call) and ``secret`` (reads an environment variable the tests give the server).

``--only multiply,fail``: the server lists those tools only (``--only ""``: none, a tool source that brings nothing).
Where ``MCP_TEST_STARTS`` names a file, each start appends its process id to it (the tests count servers started)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

# WARNING: the server's INFO log (a line per failed call) stays out of the tests' output.
server = MCPServer("calculator", log_level="WARNING")
calls = 0
only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None


def _count() -> None:
    global calls
    calls += 1


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiplies two integers."""
    _count()
    return a * b


@server.tool()
def fail(why: str) -> str:
    """Always fails, saying why."""
    _count()
    # A ToolError's message reaches the client; any other exception is answered "Error executing tool fail".
    raise ToolError(f"fail: {why}")


@server.tool()
def nap(seconds: float) -> str:
    """Sleeps, then says so."""
    _count()
    time.sleep(seconds)
    return f"slept {seconds:g} s"


@server.tool()
def whoami() -> str:
    """This server's process id and the calls it has answered, this one included."""
    _count()
    return f"{os.getpid()} {calls}"


@server.tool()
def spawn() -> str:
    """Starts a `sleep 600` child (what a server's tool running a command does) and answers its process id."""
    _count()
    return str(subprocess.Popen(["sleep", "600"]).pid)


@server.tool()
def secret() -> str:
    """The MCP_TEST_SECRET environment variable, as the server sees it."""
    _count()
    return os.environ.get("MCP_TEST_SECRET", "<unset>")


if __name__ == "__main__":
    if only is not None:
        for name in [tool.name for tool in asyncio.run(server.list_tools())]:
            if name not in only:
                server.remove_tool(name)
    if os.environ.get("MCP_TEST_STARTS"):
        with open(os.environ["MCP_TEST_STARTS"], "a") as starts:
            starts.write(f"{os.getpid()}\n")
    server.run()
