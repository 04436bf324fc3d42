"""Starts an MCP server for ``interop.tools.mcp_tools`` so that it dies with the process that started it.

``python interop/tools/_mcp_launcher.py <parent pid> <command> [args...]``: asks Linux to kill this process with its
parent (``PR_SET_PDEATHSIG``, which ``execvp`` keeps), then becomes the server (``execvp``): the server ends as soon as
the tool worker's caller process does. What the server starts, and the real server behind a launcher command (``npx``,
``uvx``, a shell), do not get the signal: the worker's keeper, a child subreaper, kills those (``_tool_worker.py``).

Dependencies: the standard library (``_tool_worker``'s ``_die_with_parent``, found beside this file).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # Run as a script: this folder is on sys.path (mypy checks interop/ as a package, where it is not).
    from _tool_worker import _die_with_parent  # type: ignore[import-not-found]

    _die_with_parent(int(sys.argv[1]))
    command = sys.argv[2:]
    try:
        os.execvp(command[0], command)
    except OSError as error:
        sys.stderr.write(f"interop.tools.mcp_tools: cannot start the MCP server {command[0]!r}: {error.strerror}\n")
        sys.stderr.flush()
        os._exit(127)
