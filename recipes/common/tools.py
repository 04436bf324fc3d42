"""The ``tools:`` node both GRPO recipes read: trl-style Python tools, resolved and checked before any model loads.

A tool is what ``trl.GRPOTrainer(tools=[...])`` takes: a function with type hints and a docstring (its ``__name__`` is
the name the model calls). The config names each under ``tools.<name>.function``, a dotted path or a ``_target_`` node
(a factory that returns the function), as ``reward.functions.<name>.function`` names reward functions; the node's
other keys are the settings of every tool:

.. code-block:: yaml

    tools:
      timeout_s: 10            # a call running longer is stopped (its worker process killed) and answered with an error
      max_result_tokens: 256   # a longer result is cut to this many tokens of the policy's tokenizer
      multiply:
        function: recipes.common.calculator.multiply

- :func:`tool_entries`: the ``<name>: {function: ...}`` entries of the node (its settings left out).
- :func:`resolve_tools`: the :class:`interop.tools.ToolSet` the node names (``None`` without tools); every refusal is
  a :class:`~recipes.common.config.ConfigError` naming the key: an entry that is not ``{function: ...}``, a module
  that is missing, something that is not callable, a function without a docstring or type hints, a setting out of
  range, ``<name>`` other than the function's name (the model calls the function by its name; a second name would
  mislead whoever reads the config).
- :func:`make_tool_runner`: the :class:`interop.tools.ToolRunner` that answers the calls (a worker process the
  caller closes).

Dependencies: omegaconf, hydra; the project's ``interop.tools`` and ``recipes.common.reward_functions`` (how a dotted
path or a ``_target_`` node is resolved).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from omegaconf import DictConfig

from interop.tools import ToolRunner, ToolSet
from recipes.common.config import ConfigError
from recipes.common.reward_functions import function_name, resolve_function

__all__ = ["SETTINGS", "make_tool_runner", "resolve_tools", "tool_entries"]

# The keys of `tools:` that are settings of every tool, not tools.
SETTINGS = ("timeout_s", "max_result_tokens")


def tool_entries(tools: Mapping | None) -> dict[str, object]:
    """``name -> node`` for each tool of the ``tools:`` node (its :data:`SETTINGS` left out)."""
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
    entries = tool_entries(tools)
    if not entries:
        return None
    _check_settings(tools)
    functions = []
    for name, node in entries.items():
        setting = f"tools.{name}"
        if not isinstance(node, (DictConfig, Mapping)) or "function" not in node:
            raise ConfigError(
                f"{setting}: expected {{function: <dotted path or _target_ node>}} (a tool), got {node!r}; the "
                f"settings of tools: are {list(SETTINGS)}."
            )
        unknown = sorted(set(node) - {"function"})
        if unknown:
            raise ConfigError(f"{setting}: unknown key(s) {unknown}; a tool node takes only function.")
        function = resolve_function(f"{setting}.function", node["function"])
        try:
            ToolSet([function])
        except ValueError as error:  # no docstring, no type hints, an argument not described: trl would refuse too
            raise ConfigError(
                f"{setting}.function={function_name(node['function'])}: {str(error).removeprefix('ToolSet: ')}"
            ) from None
        if function.__name__ != name:
            raise ConfigError(
                f"{setting}.function={function_name(node['function'])} is named {function.__name__!r}, which is the "
                f"name the model calls it by (trl's convention); rename the key to tools.{function.__name__}."
            )
        functions.append(function)
    return ToolSet(functions)


def make_tool_runner(tools: Mapping, tool_set: ToolSet, *, tokenizer) -> ToolRunner:
    """The runner of ``tool_set`` at the node's settings, cutting results with the policy's ``tokenizer``."""
    return ToolRunner(
        tool_set,
        timeout_s=float(tools["timeout_s"]),
        max_result_tokens=tools.get("max_result_tokens"),
        tokenizer=tokenizer,
    )
