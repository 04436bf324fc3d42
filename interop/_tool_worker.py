"""The process that runs tool calls for ``interop.tools.ToolRunner``: the standard library only, on purpose.

``ToolRunner`` starts it as a script (``python interop/_tool_worker.py <fd>``), not as a module of the ``interop``
package, whose ``__init__`` imports torch and torchrl: the worker starts in a few tens of milliseconds, which a restart
after a timeout pays again. It first asks Linux to kill it with its parent (``PR_SET_PDEATHSIG``), then reads, on the
connection whose file descriptor it is given:

1. ``(sys_path, main_path, pickled_tools)``: the parent's import path, the parent's main script when a tool was
   defined there (run as ``__mp_main__``, as ``multiprocessing``'s spawn does), and the tools pickled by reference;
   it calls the ``start_in_worker()`` method of each tool that has one (an MCP tool starts its server there, so that
   the server's start is not counted in a call's timeout) and answers ``("ready", None)`` or ``("failed", traceback)``;
2. then calls, ``(name, arguments, char_limit)``, one at a time, answering ``("ok", (text, cut))`` with the result as
   text (``str(result)``, as trl writes a tool's result into its message; cut at ``char_limit`` characters when that
   is not None) or ``("raised", "<error text>")``.

Dependencies: the standard library.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import os
import pickle
import runpy
import signal
import sys
import traceback
import types
from multiprocessing.connection import Connection


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except OSError:
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _load_tools(sys_path: list[str], main_path: str | None, pickled: bytes) -> dict:
    sys.path[:] = sys_path
    if main_path is not None:
        # As multiprocessing's spawn does: the parent's script, run under another name so that its
        # `if __name__ == "__main__":` block stays out, stands in for __main__ (where pickle finds its functions).
        main = types.ModuleType("__mp_main__")
        main.__dict__.update(runpy.run_path(main_path, run_name="__mp_main__"))
        sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    tools = pickle.loads(pickled)
    for tool in tools.values():
        start = getattr(tool, "start_in_worker", None)
        if callable(start):
            start()
    return tools


def _call(tool, arguments: dict):
    result = tool(**arguments)
    if inspect.isawaitable(result):  # an async tool (trl takes those too)

        async def wait():
            return await result

        result = asyncio.run(wait())
    return result


def serve(connection: Connection) -> None:
    """Answers the tool calls that arrive on ``connection`` until it closes."""
    try:
        tools = _load_tools(*connection.recv())
    except BaseException:
        connection.send(("failed", traceback.format_exc()))
        return
    connection.send(("ready", None))
    while True:
        try:
            name, arguments, char_limit = connection.recv()
        except (EOFError, OSError):
            return
        try:
            text = str(_call(tools[name], arguments))
        except TimeoutError as error:  # a tool that gave up waiting (a subprocess's timeout): counted as a timeout
            connection.send(("timeout", str(error)))
            continue
        except Exception as error:  # the tool's failure is the model's answer, as in trl: its text
            connection.send(("raised", str(error)))
            continue
        cut = char_limit is not None and len(text) > char_limit
        connection.send(("ok", (text[:char_limit] if cut else text, cut)))


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[2]))
    serve(Connection(int(sys.argv[1])))
