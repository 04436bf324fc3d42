"""The ``tools:`` node both GRPO recipes read: trl-style Python tools, resolved and checked before any model loads.

A tool is what ``trl.GRPOTrainer(tools=[...])`` takes: a function with type hints and a docstring (its ``__name__`` is
the name the model calls). The config names each under ``tools.<name>.function``, a dotted path or a ``_target_`` node
(a factory that returns the function), as ``reward.functions.<name>.function`` names reward functions. A TorchRL tool
piece (``ToolRegistry``, ``ExecuteToolsInOrder``, ``SimpleToolTransform``, ``PythonInterpreter``) is named under
``tools.<label>.torchrl``, a ``_target_`` node that builds it; it brings its tools and the format the model calls them
in (``interop.torchrl_tools``). MCP servers are named under ``tools.<label>.mcp.servers``, each described as TorchRL's
``MCPToolTransform`` describes its servers (``command``, ``args``, ``env``): their tools are listed before any model
loads and called in Qwen2.5's ``<tool_call>`` format (``interop.mcp_tools``). The node's other keys are the settings of
every tool:

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
- :func:`make_tool_runner`: the :class:`interop.tools.ToolRunner` that answers the calls (a worker process the
  caller closes).

Dependencies: omegaconf, hydra; the project's ``interop.tools`` and ``recipes.common.reward_functions`` (how a dotted
path or a ``_target_`` node is resolved).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping

from omegaconf import DictConfig, OmegaConf

from interop.tools import ToolCallFormat, ToolRunner, ToolSet
from recipes.common.config import ConfigError
from recipes.common.dotted_paths import function_name, import_from_the_working_folder, resolve_function

__all__ = ["SETTINGS", "make_tool_runner", "resolve_call_format", "resolve_tools", "tool_entries"]

log = logging.getLogger(__name__)

# The keys of `tools:` that are settings of every tool, not tools.
SETTINGS = ("timeout_s", "max_result_tokens")


def tool_entries(tools: Mapping | None) -> dict[str, object]:
    """``name -> node`` for each tool or TorchRL piece of the ``tools:`` node (its :data:`SETTINGS` left out)."""
    if not tools:
        return {}
    return {str(name): node for name, node in tools.items() if name not in SETTINGS}


def _check_settings(tools: Mapping) -> None:
    timeout = tools.get("timeout_s")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (math.isfinite(timeout) and timeout > 0)
    ):
        raise ConfigError(
            f"tools.timeout_s={timeout!r}: expected a number of seconds > 0 (a tool call running longer is stopped "
            "and answered with a timeout error)."
        )
    cut = tools.get("max_result_tokens")
    if cut is not None and (isinstance(cut, bool) or not isinstance(cut, int) or cut < 1):
        raise ConfigError(
            f"tools.max_result_tokens={cut!r}: expected an integer >= 1 (a longer result is cut to that many "
            "tokens), or null to never cut."
        )


def resolve_tools(tools: Mapping | None) -> ToolSet | None:
    """The tools ``tools:`` names, checked as trl checks them, or ``None`` when it names none.

    Raises:
        ConfigError: naming the key, for anything the module docstring lists.
    """
    resolved = _resolve(tools)
    return None if resolved is None else resolved[0]


def resolve_call_format(tools: Mapping | None):
    """The call format the model's turns are read with: ``None`` for Qwen2.5's ``<tool_call>`` JSON (the default,
    what chat templates render), else the TorchRL pieces' formats (with Qwen2.5's too when functions are named)."""
    resolved = _resolve(tools)
    if resolved is None:
        return None
    formats = resolved[1]
    if all(isinstance(fmt, ToolCallFormat) for fmt in formats):
        return None
    from interop.torchrl_tools import CombinedCallFormat

    return formats[0] if len(formats) == 1 else CombinedCallFormat(tuple(formats))


_KINDS = ("function", "torchrl", "mcp")


def _resolve(tools: Mapping | None) -> tuple[ToolSet, list] | None:
    entries = tool_entries(tools)
    if not entries:
        return None
    _check_settings(tools)
    functions, formats, origins = [], [], {}
    for name, node in entries.items():
        setting = f"tools.{name}"
        kinds = [kind for kind in _KINDS if isinstance(node, (DictConfig, Mapping)) and kind in node]
        if not kinds:
            shown = f"a node with keys {sorted(node)}" if isinstance(node, (DictConfig, Mapping)) else repr(node)
            raise ConfigError(
                f"{setting}: expected {{function: <dotted path or _target_ node>}} (a tool), {{torchrl: <_target_ "
                f"node>}} (a TorchRL tool piece) or {{mcp: {{servers: ...}}}} (MCP servers), got {shown}; the "
                f"settings of tools: are {list(SETTINGS)}."
            )
        unknown = sorted(set(node) - {kinds[0]})
        if unknown:
            raise ConfigError(
                f"{setting}: unknown key(s) {unknown}; a tool node takes function, torchrl or mcp, one of them alone."
            )
        if kinds[0] == "torchrl":
            adapted = _torchrl_piece(f"{setting}.torchrl", node["torchrl"])
            brought = [(tool, f"{setting}.torchrl") for tool in adapted.tools]
            formats.append(adapted.call_format)
        elif kinds[0] == "mcp":
            brought = _mcp_tools(f"{setting}.mcp", node["mcp"])
            formats.append(ToolCallFormat())
        else:
            brought = [(_function_tool(setting, name, node["function"]), f"{setting}.function")]
            formats.append(ToolCallFormat())
        for tool, origin in brought:
            _check_unique(tool.__name__, origin, origins)
            functions.append(tool)
    try:
        tool_set = ToolSet(functions)
    except ValueError as error:  # a piece's tool whose schema names another tool
        raise ConfigError(f"tools: {str(error).removeprefix('ToolSet: ')}") from None
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


def _function_tool(setting: str, name: str, node):
    function = resolve_function(f"{setting}.function", node)
    try:
        ToolSet([function])
    except ValueError as error:  # no docstring, no type hints, an argument not described: trl would refuse too
        raise ConfigError(f"{setting}.function={function_name(node)}: {str(error).removeprefix('ToolSet: ')}") from None
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
    """The TorchRL piece a ``_target_`` node builds, as ``interop.torchrl_tools.TorchRLTools``."""
    from hydra.utils import instantiate

    from interop.torchrl_tools import torchrl_tools

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
    except ValueError as error:
        raise ConfigError(f"{setting}._target_={target}: {str(error).removeprefix('torchrl_tools: ')}") from None


# The tools each MCP server listed, by its description: resolve_tools runs several times before and during a run
# (checks, prompts, each policy module), and each listing starts the server (seconds).
_MCP_LISTINGS: dict[str, list] = {}


def _mcp_tools(setting: str, node) -> list[tuple[object, str]]:
    """The tools of ``tools.<label>.mcp``'s servers (``interop.mcp_tools``), each with the key of the server that
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
    from interop.mcp_tools import server_from_spec  # the standard library only: mcp is imported when a server starts

    brought = []
    for name in servers:
        key = f"{setting}.servers.{name}"
        spec = _server_spec(key, servers[name])
        listing = json.dumps(spec, sort_keys=True)
        if listing not in _MCP_LISTINGS:
            try:
                _MCP_LISTINGS[listing] = server_from_spec(str(name), spec).list_tools()
            except ImportError:
                raise ConfigError(
                    f"{key}: MCP servers need the mcp package (>=2.3,<3), which is not installed: pip install "
                    "\".[mcp]\" (or pip install 'mcp>=2.3,<3')."
                ) from None
            except ValueError as error:
                raise ConfigError(f"{key}: {str(error).removeprefix('MCPStdioServer: ')}") from None
            names = [tool.__name__ for tool in _MCP_LISTINGS[listing]]
            log.info(
                "%s: MCP server %r started and lists %d tool(s): %s (stopped again: each tool worker starts its own "
                "at its start).",
                key,
                str(name),
                len(names),
                ", ".join(names),
            )
        brought += [(tool, key) for tool in _MCP_LISTINGS[listing]]
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


def make_tool_runner(tools: Mapping, tool_set: ToolSet, *, tokenizer) -> ToolRunner:
    """The runner of ``tool_set`` at the node's settings, cutting results with the policy's ``tokenizer``."""
    return ToolRunner(
        tool_set,
        timeout_s=float(tools["timeout_s"]),
        max_result_tokens=tools.get("max_result_tokens"),
        tokenizer=tokenizer,
    )
