"""MCP servers (the Model Context Protocol, stdio transport) as tools of :class:`interop.tools.ToolSet`.

A server is described as TorchRL's ``MCPToolTransform`` describes its servers: ``{"command": ..., "args": [...],
"env": {...}}``, one per server name. Its tools are listed once, when the tools are built (a short-lived client
session: the server is started, asked for its tools and stopped), each becoming an :class:`MCPTool` with the server's
name, description and JSON schema (its ``inputSchema``), called in Qwen2.5's ``<tool_call>`` format like any
:class:`~interop.tools.ToolSet` tool. The tools travel pickled to the :class:`interop.tools.ToolRunner`'s worker
process, which starts each server once (one client session per server, held by an event loop in a thread of the worker)
and sends it every call of that server's tools; a server that answers with an error result (``isError``) makes the
call raise, so the runner answers it as an error and counts it (kind ``raised``).

Tool names are the server's own. Two servers listing a tool of one name are refused, naming both: the model calls a
tool by its name alone (TorchRL's transform prefixes ``server.`` instead, in its own call format).

The server process dies with the process that started it (``PR_SET_PDEATHSIG``, set by ``_mcp_launcher.py`` before it
becomes the server), and it is below the tool worker's keeper, which kills every process below it when the worker is
stopped (a call past ``timeout_s``, the run's end, the trainer's death): the server, the real server a launcher such as
``npx`` or ``uvx`` starts as its child, and what its tools start. The next worker starts a fresh server.
The server runs as the training process's user, in its working folder, with ``HOME``, ``LOGNAME``, ``PATH``,
``SHELL``, ``TERM``, ``USER`` (what the mcp client passes on) and the ``env`` given: it is not a sandbox.

Public names:

- :func:`mcp_tools`: the tools of several servers (TorchRL's ``servers`` dict), names checked across them;
  :func:`server_from_spec`: one server from its entry of that dict.
- :class:`MCPStdioServer`: one server: :meth:`MCPStdioServer.list_tools`, and, in the process that calls its tools,
  its one client session (:meth:`~MCPStdioServer.start`, :meth:`~MCPStdioServer.call`, :meth:`~MCPStdioServer.close`).
- :class:`MCPTool`: one tool of a server, callable with its arguments, returning the result's text.

Dependencies: ``mcp>=2.3,<3`` (``pip install ".[mcp]"``), imported when a server is started; the standard library.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from interop.errors import SettingError

if TYPE_CHECKING:  # mcp is an optional dependency, imported when a server starts
    from mcp import ClientSession

__all__ = ["MCPStdioServer", "MCPTool", "mcp_tools", "server_from_spec"]

_LAUNCHER = Path(__file__).with_name("_mcp_launcher.py")
_STDERR_TAIL = 600  # characters of a failed server's stderr quoted in the error
_MAX_PAGES = 100  # tools/list pages read at most (a server that pages forever is cut off)


def _require_mcp() -> None:
    try:
        from importlib.metadata import version

        import mcp  # noqa: F401
    except ImportError:
        raise ImportError(
            'interop.tools.mcp_tools: the mcp package is not installed; MCP servers need it: pip install ".[mcp]" (or '
            "pip install 'mcp>=2.3,<3')."
        ) from None
    found = version("mcp")
    if int(found.split(".")[0]) < 2:
        raise ImportError(
            f"interop.tools.mcp_tools: mcp {found} is installed; this module needs mcp>=2.3,<3 (its 2.x API): "
            "pip install 'mcp>=2.3,<3'."
        )


class MCPStdioServer:
    """An MCP server started as a subprocess and spoken to over its stdin and stdout.

    Pickled, it carries its description only; in each process that calls its tools it holds one client session, started
    by :meth:`start` (or the first :meth:`call`) and ended by :meth:`close` or with that process.

    Args:
        name: the server's name (its key in TorchRL's ``servers`` dict), used in messages.
        command: the executable that starts the server (found on ``PATH`` as ``env`` gives it, or a path).
        args: its arguments.
        env: environment variables added to those the mcp client passes on (``HOME``, ``LOGNAME``, ``PATH``,
            ``SHELL``, ``TERM``, ``USER``); never shown in messages or ``repr`` (they may be secrets).

    Keyword Args:
        start_timeout_s: the longest the server may take to start and answer MCP's ``initialize`` and ``tools/list``.
    """

    def __init__(
        self,
        name: str,
        command: str,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        start_timeout_s: float = 60.0,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise SettingError("MCPStdioServer", f"name={name!r} must be a non-empty string.", field="name")
        if not isinstance(command, str) or not command:
            raise SettingError("MCPStdioServer", f"server {name!r}: command={command!r} must be a non-empty string.")
        if isinstance(args, str) or not all(isinstance(arg, str) for arg in args):
            raise SettingError("MCPStdioServer", f"server {name!r}: args={args!r} must be a list of strings.")
        env = dict(env or {})
        bad = sorted(str(key) for key, value in env.items() if not isinstance(key, str) or not isinstance(value, str))
        if bad:
            raise SettingError("MCPStdioServer", f"server {name!r}: env values must be strings; not so for {bad}.")
        if not start_timeout_s > 0:
            raise SettingError(
                "MCPStdioServer", f"start_timeout_s={start_timeout_s} must be > 0 (seconds).", field="start_timeout_s"
            )
        self.name, self.command, self.args, self.env = name, command, list(args), env
        self.start_timeout_s = float(start_timeout_s)
        self._connection: _Connection | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_connection": None}  # a session lives in the process that opened it

    def __repr__(self) -> str:  # env values may be secrets: their names only
        return f"MCPStdioServer({self.name!r}, command={self.command!r}, args={self.args!r}, env={sorted(self.env)})"

    @property
    def described(self) -> str:
        """The server as messages name it: its name and command line (not its env)."""
        return f"MCP server {self.name!r} ({' '.join([self.command, *self.args])})"

    def list_tools(self) -> list[MCPTool]:
        """The server's tools, listed in a short-lived session (the server is started, asked and stopped).

        Raises:
            ImportError: the mcp package is missing, or older than 2.
            ValueError: the command is not found, the server ends or stays silent before answering, or lists no tool.
        """
        _require_mcp()
        self._check_command()
        with tempfile.TemporaryFile("w+") as errlog:
            try:
                connection = _Connection(self, errlog=errlog)
            except TimeoutError:
                raise ValueError(
                    f"{self.described} did not answer MCP's initialize within {self.start_timeout_s:g} s; is it an "
                    f"MCP server speaking over stdio?{_tail(errlog, self.env)}"
                ) from None
            except Exception as error:
                raise ValueError(
                    f"{self.described} ended before answering MCP's initialize ({_reason(error)})."
                    f"{_tail(errlog, self.env)}"
                ) from None
            try:
                listed = connection.run(_list_all(connection.session), timeout=self.start_timeout_s)
            except Exception as error:
                raise ValueError(
                    f"{self.described} could not list its tools ({_reason(error)}).{_tail(errlog, self.env)}"
                ) from None
            finally:
                connection.close()
        if not listed:
            raise ValueError(f"{self.described} lists no tools; a tool source needs at least one.")
        return [MCPTool(self, tool.name, _description(tool, self.name), tool.input_schema) for tool in listed]

    def _check_command(self) -> None:
        path = self.env.get("PATH", os.environ.get("PATH"))
        if shutil.which(self.command, path=path) is None:
            raise ValueError(
                f"{self.described}: command {self.command!r} is not found (not an executable file, nor on PATH); "
                "install it, or give its full path."
            )

    def start(self) -> None:
        """Starts the server and its client session in this process, unless they run already."""
        if self._connection is None:
            _require_mcp()
            self._check_command()
            self._connection = _Connection(self, errlog=_stderr())

    def call(self, tool: str, arguments: Mapping) -> str:
        """Calls ``tool`` with ``arguments`` on this process's session (:meth:`start`-ed when needed) and returns the
        result's text: its text contents, one per line (a non-text content as ``[image image/png]``...), or its
        structured content as JSON when it has no content.

        Raises:
            RuntimeError: the server answered with an error result (``isError``: the error's text), or the
                connection failed (the session is then dropped: the next call starts the server again).
        """
        self.start()
        connection = self._connection
        assert connection is not None  # start() opened it
        try:
            result = connection.run(connection.session.call_tool(tool, dict(arguments)))
        except Exception as error:
            if _connection_lost(error):
                self.close()
            raise RuntimeError(f"{self.described}: the call of {tool!r} failed: {_reason(error)}") from None
        text = _result_text(result)
        if result.is_error:
            raise RuntimeError(text or f"{self.described}: {tool!r} answered with an error and no text.")
        return text

    def close(self) -> None:
        """Ends this process's session and stops the server (a later call starts it again)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()


class MCPTool:
    """One tool of an :class:`MCPStdioServer`, for a :class:`~interop.tools.ToolSet`: named as the server names it,
    its ``json_schema`` made of the server's description and ``inputSchema``. Called with the model's arguments, it
    returns the result's text (:meth:`MCPStdioServer.call`). Tools of one server pickled together share it, so a tool
    worker holds one session per server."""

    def __init__(self, server: MCPStdioServer, name: str, description: str, parameters: Mapping) -> None:
        self.server, self.__name__ = server, name
        self.json_schema = {
            "type": "function",
            "function": {"name": name, "description": description, "parameters": dict(parameters)},
        }

    def __call__(self, **arguments) -> str:
        return self.server.call(self.__name__, arguments)

    def start_in_worker(self) -> str:
        """Called by the tool worker once it has loaded the tools, before the first call (so that the server's start
        is not counted in the call's timeout); returns what happened, which the runner logs. A server that fails to
        start here is tried again by the call, whose answer then says why."""
        try:
            self.server.start()
        except Exception as error:
            return f"{self.server.described} did not start ({_reason(error)}); each call of its tools tries again."
        return f"{self.server.described} started."

    def __repr__(self) -> str:
        return f"MCPTool({self.__name__!r}, server={self.server.name!r})"


def mcp_tools(servers: Mapping[str, Mapping], *, start_timeout_s: float = 60.0) -> list[MCPTool]:
    """The tools of every server of ``servers``, as TorchRL's ``MCPToolTransform(servers=...)`` takes them:
    ``{name: {"command": ..., "args": [...], "env": {...}}}`` (``args`` and ``env`` optional).

    Raises:
        ImportError: the mcp package is missing (``pip install ".[mcp]"``).
        ValueError: a server described wrongly, that does not start, answers no MCP or lists no tool; two servers
            listing a tool of one name (both named).

    Examples:
        A server written with the mcp package (``calculator_server.py``: ``MCPServer("calc")`` with a ``multiply``
        tool, ending in ``server.run()``)::

            >>> import sys
            >>> servers = {"calc": {"command": sys.executable, "args": ["calculator_server.py"]}}
            >>> tools = mcp_tools(servers)  # doctest: +SKIP
            >>> tools  # doctest: +SKIP
            [MCPTool('multiply', server='calc')]
            >>> with ToolRunner(tools, timeout_s=10, max_result_tokens=None) as runner:  # doctest: +SKIP
            ...     runner.run_one(ToolCall("multiply", {"a": 12, "b": 34}, "")).content
            '408'
    """
    if not isinstance(servers, Mapping) or not servers:
        raise ValueError(f"mcp_tools: servers={servers!r} must be a non-empty dict of name -> {{command, args, env}}.")
    tools: list[MCPTool] = []
    owners: dict[str, str] = {}
    for name, spec in servers.items():
        server = server_from_spec(str(name), spec, start_timeout_s=start_timeout_s)
        for tool in server.list_tools():
            if tool.__name__ in owners:
                raise ValueError(
                    f"mcp_tools: MCP servers {owners[tool.__name__]!r} and {name!r} both list a tool named "
                    f"{tool.__name__!r}; the model calls a tool by its name alone, so names must be unique: drop one "
                    "of the servers, or have one list the tool under another name."
                )
            owners[tool.__name__] = name
            tools.append(tool)
    return tools


_SPEC_KEYS = ("command", "args", "env")


def server_from_spec(name: str, spec: Mapping, *, start_timeout_s: float = 60.0) -> MCPStdioServer:
    """An :class:`MCPStdioServer` from TorchRL's description of one server (``{"command", "args", "env"}``)."""
    if not isinstance(spec, Mapping) or "command" not in spec:
        raise ValueError(f"mcp_tools: server {name!r}: expected {{command: ..., args: [...], env: {{...}}}}.")
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"mcp_tools: server {name!r}: unknown key(s) {unknown}; a server takes {list(_SPEC_KEYS)}.")
    return MCPStdioServer(
        name, spec["command"], spec.get("args") or (), spec.get("env"), start_timeout_s=start_timeout_s
    )


class _Connection:
    """One client session with a stdio server, held open by a task of an event loop running in a daemon thread of
    this process: the loop thread is the server's parent, whose end kills it (``PR_SET_PDEATHSIG``)."""

    def __init__(self, server: MCPStdioServer, *, errlog) -> None:
        import asyncio
        import concurrent.futures
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp-{server.name}", daemon=True)
        self._thread.start()
        self._ready: concurrent.futures.Future[ClientSession] = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self._held = asyncio.run_coroutine_threadsafe(self._hold(server, errlog), self._loop)
        try:
            self.session = self._ready.result(timeout=server.start_timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            raise TimeoutError(f"{server.described} did not answer within {server.start_timeout_s:g} s.") from None
        except BaseException:
            self.close()
            raise

    async def _hold(self, server: MCPStdioServer, errlog) -> None:
        import asyncio

        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        launcher = [sys.executable, "-S", str(_LAUNCHER), str(os.getpid()), server.command, *server.args]
        parameters = StdioServerParameters(command=launcher[0], args=launcher[1:], env=server.env or None)
        try:
            async with stdio_client(parameters, errlog=errlog) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    self._stop = asyncio.Event()
                    self._ready.set_result(session)
                    await self._stop.wait()
        except BaseException as error:
            if self._ready.done():
                raise
            self._ready.set_exception(_leaf(error))

    def run(self, coroutine, timeout: float | None = None):
        """Runs ``coroutine`` on the session's loop and returns its result (waiting at most ``timeout`` seconds)."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=timeout)

    def close(self) -> None:
        """Ends the session: the mcp client closes the server's stdin, waits for it to exit, then kills it."""
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        else:
            self._held.cancel()
        try:
            self._held.result(timeout=10)
        except BaseException:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()


async def _list_all(session) -> list:
    from mcp.types import PaginatedRequestParams

    tools, cursor = [], None
    for _ in range(_MAX_PAGES):
        page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def _description(tool, server: str) -> str:
    return tool.description or tool.title or f"The {tool.name} tool of MCP server {server!r}."


def _result_text(result) -> str:
    parts = []
    for content in result.content:
        kind = getattr(content, "type", "")
        if kind == "text":
            parts.append(content.text)
        elif kind == "resource" and hasattr(content.resource, "text"):
            parts.append(content.resource.text)
        elif kind == "resource_link":
            parts.append(f"[resource {content.uri}]")
        else:  # images, audio, binary resources: the model reads text only
            mime = getattr(content, "mime_type", None) or getattr(getattr(content, "resource", None), "mime_type", None)
            parts.append(f"[{kind} {mime or 'content'}]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


def _leaf(error: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: anyio's task groups wrap what went wrong."""
    while inner := getattr(error, "exceptions", None):  # an ExceptionGroup (the exceptiongroup backport on 3.10)
        error = inner[0]
    return error


def _reason(error: BaseException) -> str:
    error = _leaf(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _connection_lost(error: BaseException) -> bool:
    """Whether a failed call left the session unusable (the server gone), rather than answered with an error."""
    from mcp import MCPError
    from mcp.types import CONNECTION_CLOSED

    error = _leaf(error)
    return not isinstance(error, MCPError) or error.code == CONNECTION_CLOSED


def _tail(errlog, env: Mapping[str, str]) -> str:
    errlog.flush()
    errlog.seek(0)
    text = _without_env_values(errlog.read(), env).strip()
    if not text:
        return ""
    return f" Its stderr ends with: {text[-_STDERR_TAIL:]!r}"


def _without_env_values(text: str, env: Mapping[str, str]) -> str:
    """``text`` with each value of ``env`` shown as ``<NAME>``: a server's env holds its keys, which a server failing
    at start may print, and its stderr is quoted in the error. Longest values first (one may contain another); a value
    under 4 characters (``DEBUG=1``) only where it stands alone, not inside a longer word or number (``line 12``).

    Examples:
        >>> _without_env_values("bad key sk-123 at line 12: 1", {"API_KEY": "sk-123", "DEBUG": "1"})
        'bad key <API_KEY> at line 12: <DEBUG>'
    """
    for name, value in sorted(env.items(), key=lambda item: -len(item[1])):
        if not value:
            continue
        pattern = re.escape(value) if len(value) >= 4 else rf"(?<![\w.-]){re.escape(value)}(?![\w.-])"
        text = re.sub(pattern, f"<{name}>".replace("\\", r"\\"), text)  # a literal replacement: backslashes escaped
    return text


def _stderr():
    """Where a server started to answer calls writes its log: this process's stderr, when it is a real file."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return tempfile.TemporaryFile("w+")
