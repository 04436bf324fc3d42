"""The ``tools:`` node both GRPO recipes read: trl-style Python tools, resolved and checked before any model loads.

A tool is what ``trl.GRPOTrainer(tools=[...])`` takes: a function with type hints and a docstring (its ``__name__`` is
the name the model calls). The config names each under ``tools.<name>.function``, a dotted path or a ``_target_`` node
(a factory that returns the function), as ``reward.functions.<name>.function`` names reward functions. A TorchRL tool
piece (``ToolRegistry``, ``ExecuteToolsInOrder``, ``SimpleToolTransform``, ``PythonInterpreter``) is named under
``tools.<label>.torchrl``, a ``_target_`` node that builds it; it brings its tools and the format the model calls them
in (``interop.torchrl_tools``). The node's other keys are the settings of every tool:

.. code-block:: yaml

    tools:
      timeout_s: 10            # a call running longer is stopped (its worker process killed) and answered with an error
      max_result_tokens: 256   # a longer result is cut to this many tokens of the policy's tokenizer
      multiply:
        function: recipes.common.calculator.multiply
      python:                  # a label: a TorchRL piece may bring several tools
        torchrl:
          _target_: torchrl.envs.llm.transforms.PythonInterpreter
          timeout: 5

- :func:`tool_entries`: the ``<name>: {function: ...}`` and ``<label>: {torchrl: ...}`` entries of the node (its
  settings left out).
- :func:`resolve_tools`: the :class:`interop.tools.ToolSet` the node names (``None`` without tools); every refusal is
  a :class:`~recipes.common.config.ConfigError` naming the key: an entry that is neither ``{function: ...}`` nor
  ``{torchrl: ...}``, a module that is missing, something that is not callable or not a TorchRL tool piece, a
  function without a docstring or type hints, a setting out of range, ``<name>`` other than the function's name (the
  model calls the function by its name; a second name would mislead whoever reads the config).
- :func:`resolve_call_format`: how the model's turns are read for calls: ``None`` (Qwen2.5's ``<tool_call>``, the
  default) unless a TorchRL piece brings its own format.
- :func:`make_tool_runner`: the :class:`interop.tools.ToolRunner` that answers the calls (a worker process the
  caller closes).

Dependencies: omegaconf, hydra; the project's ``interop.tools`` and ``recipes.common.reward_functions`` (how a dotted
path or a ``_target_`` node is resolved).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from omegaconf import DictConfig

from interop.tools import ToolCallFormat, ToolRunner, ToolSet
from recipes.common.config import ConfigError
from recipes.common.reward_functions import _import_from_the_working_folder, function_name, resolve_function

__all__ = ["SETTINGS", "make_tool_runner", "resolve_call_format", "resolve_tools", "tool_entries"]

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


def _resolve(tools: Mapping | None) -> tuple[ToolSet, list] | None:
    entries = tool_entries(tools)
    if not entries:
        return None
    _check_settings(tools)
    functions, formats = [], []
    for name, node in entries.items():
        setting = f"tools.{name}"
        if not isinstance(node, (DictConfig, Mapping)) or not ({"function", "torchrl"} & set(node)):
            raise ConfigError(
                f"{setting}: expected {{function: <dotted path or _target_ node>}} (a tool) or {{torchrl: <_target_ "
                f"node>}} (a TorchRL tool piece), got {node!r}; the settings of tools: are {list(SETTINGS)}."
            )
        unknown = sorted(set(node) - {"function"}) if "function" in node else sorted(set(node) - {"torchrl"})
        if unknown:
            raise ConfigError(f"{setting}: unknown key(s) {unknown}; a tool node takes function, or torchrl alone.")
        if "torchrl" in node:
            adapted = _torchrl_piece(f"{setting}.torchrl", node["torchrl"])
            functions += adapted.tools
            formats.append(adapted.call_format)
            continue
        functions.append(_function_tool(setting, name, node["function"]))
        formats.append(ToolCallFormat())
    try:
        tool_set = ToolSet(functions)
    except ValueError as error:  # two pieces bringing tools of one name
        raise ConfigError(f"tools: {str(error).removeprefix('ToolSet: ')}") from None
    unique = []
    for fmt in formats:
        if not any(_same_format(fmt, seen) for seen in unique):
            unique.append(fmt)
    return tool_set, unique


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
    "MCPToolTransform": "not supported: it connects to its MCP servers when built and holds those connections in a "
    "thread of its own, which the tool worker cannot take over (and no MCP server is reachable offline to test one). "
    "Wrap each MCP tool in a ToolService of a ToolRegistry, or in a Python function tool",
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
    _import_from_the_working_folder()
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


def make_tool_runner(tools: Mapping, tool_set: ToolSet, *, tokenizer) -> ToolRunner:
    """The runner of ``tool_set`` at the node's settings, cutting results with the policy's ``tokenizer``."""
    return ToolRunner(
        tool_set,
        timeout_s=float(tools["timeout_s"]),
        max_result_tokens=tools.get("max_result_tokens"),
        tokenizer=tokenizer,
    )
