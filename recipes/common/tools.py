"""The ``tools:`` node both GRPO recipes read: trl-style Python tools, resolved and checked before any model loads.

A tool is what ``trl.GRPOTrainer(tools=[...])`` takes: a function with type hints and a docstring (its ``__name__`` is
the name the model calls). The config names each under ``tools.<name>.function``, a dotted path or a ``_target_`` node
(a factory that returns the function), as ``reward.functions.<name>.function`` names reward functions. A TorchRL tool
piece (``ToolRegistry``, ``ExecuteToolsInOrder``, ``SimpleToolTransform``, ``PythonInterpreter``) is named under
``tools.<label>.torchrl``, a ``_target_`` node that builds it; it brings its tools and the format the model calls them
in (``interop.tools.torchrl_tools``). MCP servers are named under ``tools.<label>.mcp.servers``, each described as
TorchRL's ``MCPToolTransform`` describes its servers (``command``, ``args``, ``env``): their tools are listed before
any model loads and called in Qwen2.5's ``<tool_call>`` format (``interop.tools.mcp_tools``). The node's other keys are
the settings of every tool:

.. code-block:: yaml

    tools:
      timeout_s: 10            # a call running longer is stopped (its worker process killed) and answered with an error
      max_result_tokens: 256   # a longer result is cut to this many tokens of the policy's tokenizer
      multiply:
        function: recipes.tasks.calculator.multiply
      python:                  # a label: a TorchRL piece may bring several tools
        torchrl:
          _target_: torchrl.envs.llm.transforms.PythonInterpreter
          timeout: 5
      calculator:              # a label: an MCP server brings the tools it lists
        mcp:
          servers:
            calc: {command: python, args: [calculator_server.py], env: {API_KEY: "${oc.env:CALC_KEY}"}}

Each function takes the node as a recipe's typed settings hold it (``recipes.common.schema.ToolsNode``) or as a
mapping.

- :func:`tool_entries`: the ``<name>: {function: ...}``, ``<label>: {torchrl: ...}`` and ``<label>: {mcp: ...}``
  entries of the node (its settings left out).
- :func:`resolve_tools`: the :class:`interop.tools.ToolSet` the node names (``None`` without tools); every refusal is
  a :class:`~recipes.common.config.ConfigError` naming the key: an entry that is not ``{function: ...}``,
  ``{torchrl: ...}`` or ``{mcp: ...}``, a module that is missing, something that is not callable or not a TorchRL tool
  piece, a function without a docstring or type hints, a setting out of range, ``<name>`` other than the function's
  name (the model calls the function by its name; a second name would mislead whoever reads the config), the mcp
  package missing, an MCP server that does not start or lists no tool, two entries bringing tools of one name.
- :func:`resolve_call_format`: how the model's turns are read for calls: ``None`` (Qwen2.5's ``<tool_call>``, the
  default) unless a TorchRL piece brings its own format.
- :data:`TOOL_KINDS`: the one table of entry kinds (``function``, ``torchrl``, ``mcp``: :class:`ToolKind`), which
  :func:`resolve_tools` dispatches on; a new kind is a builder and a row there.
- :func:`resolving_tools_once`: the scope of one run, in which each MCP server is started once to list its tools.
- :func:`make_tool_runner`: the :class:`interop.tools.ToolRunner` that answers the calls (a worker process the
  caller closes).

Dependencies: omegaconf, hydra; the project's ``interop.tools`` and ``recipes.common.reward_functions`` (how a dotted
path or a ``_target_`` node is resolved).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from interop.errors import SettingError
from interop.tools import ToolCallFormat, ToolRunner, ToolSet
from recipes.common.config import ConfigError, setting_message
from recipes.common.dotted_paths import function_name, import_from_the_working_folder, resolve_function
from recipes.common.schema import ToolsNode

__all__ = [
    "SETTINGS",
    "TOOL_KINDS",
    "ToolKind",
    "make_tool_runner",
    "resolving_tools_once",
    "resolve_call_format",
    "resolve_tools",
    "tool_entries",
]

log = logging.getLogger(__name__)

# The keys of `tools:` that are settings of every tool, not tools.
SETTINGS = ("timeout_s", "max_result_tokens")


# The tools: node as a recipe's typed settings hold it (recipes.common.schema.ToolsNode: its settings, and its entries
# apart), or as written (a mapping: the settings beside the entries).
Tools = ToolsNode | Mapping


def tool_entries(tools: Tools | None) -> dict[str, object]:
    """``name -> node`` for each tool or TorchRL piece of the ``tools:`` node (its :data:`SETTINGS` left out)."""
    if isinstance(tools, ToolsNode):
        return dict(tools.entries)
    if not tools:
        return {}
    return {str(name): node for name, node in tools.items() if name not in SETTINGS}


def _setting(tools: Tools, name: str):
    """One of the node's :data:`SETTINGS` (``None`` where a mapping lacks it: the runner's check names it)."""
    return getattr(tools, name) if isinstance(tools, ToolsNode) else tools.get(name)


def _check_settings(tools: Tools) -> None:
    """``tools.timeout_s`` and ``tools.max_result_tokens``, checked by the runner that takes them."""
    try:
        ToolRunner.check_settings(
            timeout_s=_setting(tools, "timeout_s"), max_result_tokens=_setting(tools, "max_result_tokens")
        )
    except SettingError as error:
        raise ConfigError(setting_message(error, "tools")) from None


def resolve_tools(tools: Tools | None) -> ToolSet | None:
    """The tools ``tools:`` names, checked as trl checks them, or ``None`` when it names none.

    Raises:
        ConfigError: naming the key, for anything the module docstring lists.
    """
    resolved = _resolve(tools)
    return None if resolved is None else resolved[0]


def resolve_call_format(tools: Tools | None):
    """The call format the model's turns are read with: ``None`` for Qwen2.5's ``<tool_call>`` JSON (the default,
    what chat templates render), else the TorchRL pieces' formats (with Qwen2.5's too when functions are named)."""
    resolved = _resolve(tools)
    if resolved is None:
        return None
    formats = resolved[1]
    if all(isinstance(fmt, ToolCallFormat) for fmt in formats):
        return None
    from interop.tools.torchrl_tools import CombinedCallFormat

    return formats[0] if len(formats) == 1 else CombinedCallFormat(tuple(formats))


def _resolve(tools: Tools | None) -> tuple[ToolSet, list] | None:
    entries = tool_entries(tools)
    if not entries:
        return None
    _check_settings(tools)
    functions, formats, origins = [], [], {}
    for name, node in entries.items():
        setting = f"tools.{name}"
        kinds = [kind for kind in TOOL_KINDS if isinstance(node, (DictConfig, Mapping)) and kind in node]
        if not kinds:
            shown = f"a node with keys {sorted(node)}" if isinstance(node, (DictConfig, Mapping)) else repr(node)
            shapes = [f"{{{kind}: {entry.node}}} ({entry.summary})" for kind, entry in TOOL_KINDS.items()]
            raise ConfigError(
                f"{setting}: expected {', '.join(shapes[:-1])} or {shapes[-1]}, got {shown}; the settings of tools: "
                f"are {list(SETTINGS)}."
            )
        unknown = sorted(set(node) - {kinds[0]})
        if unknown:
            raise ConfigError(
                f"{setting}: unknown key(s) {unknown}; a tool node takes {', '.join(list(TOOL_KINDS)[:-1])} or "
                f"{list(TOOL_KINDS)[-1]}, one of them alone."
            )
        brought, call_format = TOOL_KINDS[kinds[0]].build(setting, name, node[kinds[0]])
        formats.append(call_format)
        for tool, origin in brought:
            _check_unique(tool.__name__, origin, origins)
            functions.append(tool)
    try:
        tool_set = ToolSet(functions)
    except SettingError as error:  # a piece's tool whose schema names another tool
        raise ConfigError(setting_message(error, "tools")) from None
    unique = []
    for fmt in formats:
        if not any(_same_format(fmt, seen) for seen in unique):
            unique.append(fmt)
    return tool_set, unique


def _check_unique(name: str, origin: str, origins: dict[str, str]) -> None:
    """Records that ``origin`` brings a tool called ``name``; refuses a second source of one name, naming both."""
    if name in origins:
        raise ConfigError(
            f"tools: {origins[name]} and {origin} both bring a tool named {name!r}; the model calls a tool by its "
            "name alone, so tool names must be unique: drop one of them (or have the MCP server list it under "
            "another name)."
        )
    origins[name] = origin


def _same_format(a, b) -> bool:
    parser_a, parser_b = getattr(a, "parser", None), getattr(b, "parser", None)
    if parser_a is not None or parser_b is not None:
        return type(a) is type(b) and type(parser_a) is type(parser_b)
    return a == b


def _function_entry(setting: str, name: str, node) -> tuple[list[tuple[object, str]], ToolCallFormat]:
    """``tools.<name>.function``: one function, called in Qwen2.5's ``<tool_call>`` format."""
    return [(_function_tool(setting, name, node), f"{setting}.function")], ToolCallFormat()


def _torchrl_entry(setting: str, name: str, node) -> tuple[list[tuple[object, str]], object]:
    """``tools.<label>.torchrl``: a TorchRL piece's tools, in the format it reads calls in."""
    adapted = _torchrl_piece(f"{setting}.torchrl", node)
    return [(tool, f"{setting}.torchrl") for tool in adapted.tools], adapted.call_format


def _mcp_entry(setting: str, name: str, node) -> tuple[list[tuple[object, str]], ToolCallFormat]:
    """``tools.<label>.mcp``: the tools its servers list, called in Qwen2.5's ``<tool_call>`` format."""
    return _mcp_tools(f"{setting}.mcp", node), ToolCallFormat()


def _function_tool(setting: str, name: str, node):
    function = resolve_function(f"{setting}.function", node)
    try:
        ToolSet([function])
    except SettingError as error:  # no docstring, no type hints, an argument not described: trl would refuse too
        raise ConfigError(setting_message(error, f"{setting}.function={function_name(node)}")) from None
    if function.__name__ != name:
        raise ConfigError(
            f"{setting}.function={function_name(node)} is named {function.__name__!r}, which is the name the model "
            f"calls it by (trl's convention); rename the key to tools.{function.__name__}."
        )
    return function


# Pieces refused from their _target_ alone: building them starts processes (a pool of interpreters) or connects to
# servers, which nothing should do before the config is accepted.
_REFUSED_UNBUILT = {
    "PythonExecutorService": "a pool of persistent interpreters (a Ray actor's): one dialog's variables would reach "
    "another's, and building it starts its processes. Use torchrl.envs.llm.transforms.PythonInterpreter (a fresh "
    "process per call)",
    "MCPToolTransform": "not built here: it connects to its MCP servers when built and holds those connections in a "
    "thread of its own, which the tool worker cannot take over. Name its servers under tools.<label>.mcp.servers "
    "instead, as MCPToolTransform(servers=...) takes them ({<server>: {command: ..., args: [...], env: {...}}}): "
    "their tools are listed before any model loads and called through the tool worker (docs/tools.md, MCP servers)",
}


def _torchrl_piece(setting: str, node):
    """The TorchRL piece a ``_target_`` node builds, as ``interop.tools.torchrl_tools.TorchRLTools``."""
    from hydra.utils import instantiate

    from interop.tools.torchrl_tools import torchrl_tools

    if not isinstance(node, (DictConfig, Mapping)) or "_target_" not in node:
        raise ConfigError(
            f"{setting}: expected a {{_target_: ...}} node building a TorchRL tool piece (e.g. _target_: "
            f"torchrl.envs.llm.transforms.PythonInterpreter), got {node!r}."
        )
    target = function_name(node)
    reason = _REFUSED_UNBUILT.get(target.rsplit(".", 1)[-1])
    if reason is not None:
        raise ConfigError(f"{setting}._target_={target}: {reason}.")
    import_from_the_working_folder()
    try:
        piece = instantiate(node)
    except Exception as error:  # a missing module, a wrong argument: the user needs the setting named
        raise ConfigError(
            f"{setting}._target_={target} cannot be built ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200]}). It takes a TorchRL tool piece's class (e.g. "
            "torchrl.envs.llm.transforms.PythonInterpreter) or a factory returning one, importable from the Python "
            "path or the folder the run started from."
        ) from None
    try:
        return torchrl_tools(piece)
    except SettingError as error:
        raise ConfigError(setting_message(error, f"{setting}._target_={target}")) from None
    except ValueError as error:  # a tool the piece brings (ServiceTool, FunctionTool...) refusing its own values
        raise ConfigError(f"{setting}._target_={target}: {error}") from None


# The tools each MCP server listed, by its description, for the run in progress (resolving_tools_once): the run
# resolves tools: several times (checks, prompts, each policy module), and each listing starts the server (seconds).
# Outside a run every resolution lists afresh; each run gets its own listings.
_RUN_LISTINGS: contextvars.ContextVar[dict[str, list] | None] = contextvars.ContextVar("mcp_listings", default=None)


class _RunScope(contextlib.ContextDecorator):
    """:func:`resolving_tools_once`'s scope: a class rather than a generator-based context manager, so that a recipe's
    ``train`` it decorates still pickles (a Hydra joblib sweep sends the task function to its workers, and a
    generator does not pickle)."""

    def __init__(self) -> None:
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> _RunScope:
        self._tokens.append(_RUN_LISTINGS.set({}))
        return self

    def __exit__(self, *exc_info) -> None:
        _RUN_LISTINGS.reset(self._tokens.pop())


def resolving_tools_once() -> _RunScope:
    """The scope of one run (or one sampling process): inside it each MCP server of ``tools:`` is started once to
    list its tools, whatever the number of resolutions; a run in the same process after it lists them again (a server
    may list other tools by then). Used as a decorator of a recipe's ``train`` and of a collector process's entry, or
    as a ``with`` block."""
    return _RunScope()


def _mcp_tools(setting: str, node) -> list[tuple[object, str]]:
    """The tools of ``tools.<label>.mcp``'s servers (``interop.tools.mcp_tools``), each with the key of the server that
    lists it. Env values are never shown in a message: they may be secrets."""
    if not isinstance(node, (DictConfig, Mapping)) or set(node) != {"servers"}:
        got = f"keys {sorted(node)}" if isinstance(node, (DictConfig, Mapping)) else repr(node)
        raise ConfigError(
            f"{setting}: expected {{servers: {{<server>: {{command: ..., args: [...], env: {{...}}}}}}}} (as TorchRL's "
            f"MCPToolTransform(servers=...) takes them), got {got}."
        )
    servers = node["servers"]
    if not isinstance(servers, (DictConfig, Mapping)) or not servers:
        raise ConfigError(f"{setting}.servers: expected one entry per server, {{<server>: {{command: ...}}}}.")
    # The standard library only: mcp is imported when a server starts.
    from interop.tools.mcp_tools import server_from_spec

    brought = []
    for name in servers:
        key = f"{setting}.servers.{name}"
        spec = _server_spec(key, servers[name])
        listing = json.dumps(spec, sort_keys=True)
        run_listings = _RUN_LISTINGS.get()
        listings = {} if run_listings is None else run_listings
        if listing not in listings:
            try:
                listings[listing] = server_from_spec(str(name), spec).list_tools()
            except ImportError:
                raise ConfigError(
                    f"{key}: MCP servers need the mcp package (>=2.3,<3), which is not installed: pip install "
                    "\".[mcp]\" (or pip install 'mcp>=2.3,<3')."
                ) from None
            except SettingError as error:  # its fields are MCPStdioServer's arguments, not keys under this one
                raise ConfigError(f"{key}: {error.detail}") from None
            except ValueError as error:  # the server's listing, or its spec (interop.mcp_tools names which)
                raise ConfigError(f"{key}: {error}") from None
            names = [tool.__name__ for tool in listings[listing]]
            log.info(
                "%s: MCP server %r started and lists %d tool(s): %s (stopped again: each tool worker starts its own "
                "at its start).",
                key,
                str(name),
                len(names),
                ", ".join(names),
            )
        brought += [(tool, key) for tool in listings[listing]]
    return brought


def _server_spec(key: str, node) -> dict:
    """One server's ``{command, args, env}`` as strings (YAML numbers written as text), checked."""
    if not isinstance(node, (DictConfig, Mapping)) or not isinstance(node.get("command"), str) or not node["command"]:
        got = f"keys {sorted(node)}" if isinstance(node, (DictConfig, Mapping)) else repr(node)
        raise ConfigError(
            f"{key}: expected {{command: <executable>, args: [...], env: {{...}}}} with a command string, got {got}."
        )
    unknown = sorted(set(node) - {"command", "args", "env"})
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {unknown}; a server takes command, args and env.")
    spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    args, env = spec.get("args") or [], spec.get("env") or {}
    if not isinstance(args, list) or not all(_is_text(arg) for arg in args):
        raise ConfigError(f"{key}.args={args!r}: expected a list of strings (numbers are written as text).")
    if not isinstance(env, dict) or not all(_is_text(value) for value in env.values()):
        raise ConfigError(
            f"{key}.env: expected NAME: value entries whose values are strings or numbers (keys {sorted(env)})."
            if isinstance(env, dict)
            else f"{key}.env: expected NAME: value entries, got a {type(env).__name__}."
        )
    return {"command": spec["command"], "args": [str(arg) for arg in args], "env": {k: str(v) for k, v in env.items()}}


def _is_text(value) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ToolKind:
    """One kind of ``tools:`` entry, ``tools.<name>.<kind>``.

    Attributes:
        node: the node it takes, as an error shows it.
        summary: what it is, for people (``docs/tools.md`` and the ``tools:`` comment of the recipes' YAML name every
            kind).
        build: ``(setting, name, node) -> (brought, call_format)``: the tools the node brings, each with the key that
            brings it, and the format the model calls them in; every refusal a ConfigError naming the key.
    """

    node: str
    summary: str
    build: Callable[[str, str, object], tuple[list[tuple[object, str]], object]]


# Every kind of tools: entry: adding one is a builder above and a row here, and its name in docs/tools.md and the
# tools: comment of the YAML (tests/test_registries.py holds them together); the runtime it needs lives in interop/.
TOOL_KINDS: dict[str, ToolKind] = {
    "function": ToolKind("<dotted path or _target_ node>", "a tool", _function_entry),
    "torchrl": ToolKind("<_target_ node>", "a TorchRL tool piece", _torchrl_entry),
    "mcp": ToolKind("{servers: ...}", "MCP servers", _mcp_entry),
}


def make_tool_runner(tools: Tools, tool_set: ToolSet, *, tokenizer) -> ToolRunner:
    """The runner of ``tool_set`` at the node's settings, cutting results with the policy's ``tokenizer``."""
    return ToolRunner(
        tool_set,
        timeout_s=float(_setting(tools, "timeout_s")),
        max_result_tokens=_setting(tools, "max_result_tokens"),
        tokenizer=tokenizer,
    )
