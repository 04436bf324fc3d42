"""The tools wing: tool calls run in a worker process, and dialogs sampled with them.

- :mod:`interop.tools.runner`: :class:`ToolSet` (typed, documented functions as trl's ``tools=`` takes them),
  :class:`ToolRunner` (runs the calls in a worker process with a time limit, the worker replaced when it dies or
  overruns; its entry script: ``interop/tools/_tool_worker.py``), :class:`ToolCallFormat` (how calls are written and
  parsed) and the call/result records (:class:`ToolCall`, :class:`ToolResult`, :class:`ToolStats`...).
- :mod:`interop.tools.dialogs`: :class:`~interop.tools.dialogs.DialogSampler`, whole dialogs (the model writes, its
  tool calls run, their results join the chat, it writes on) sampled with a :class:`~interop.CausalLMSampler`.
- :mod:`interop.tools.dialog_policy`: :class:`~interop.tools.dialog_policy.DialogPolicy`, those dialogs as a TorchRL
  policy.
- :mod:`interop.tools.torchrl_tools`: TorchRL's tool transforms (``PythonInterpreter``, ``XMLBlockParser``...) as
  tools and call formats of a :class:`ToolRunner`.
- :mod:`interop.tools.mcp_tools`: the tools of MCP servers (stdio), each server dying with its worker (its launcher:
  ``interop/tools/_mcp_launcher.py``).

Importing this package or :mod:`interop.tools.runner` costs no torch import (a restarted tool worker pays none); the
names below are read from their module when first used (PEP 562).

Dependencies: the standard library and ``cloudpickle`` (runner); ``transformers`` for tool schemas; ``torch`` for the
dialogs; ``torchrl`` and ``mcp`` for their tools.
"""

from typing import TYPE_CHECKING

from interop._exports import lazy_exports as _lazy_exports

if TYPE_CHECKING:
    from interop.tools.runner import (
        DEFAULT_TIMEOUT_S,
        ERROR_KINDS,
        MAX_RESULT_CHARS,
        ParsedTurn,
        ToolCall,
        ToolCallFormat,
        ToolResult,
        ToolRunner,
        ToolSet,
        ToolStats,
        error_content,
    )

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ERROR_KINDS",
    "MAX_RESULT_CHARS",
    "ParsedTurn",
    "ToolCall",
    "ToolCallFormat",
    "ToolResult",
    "ToolRunner",
    "ToolSet",
    "ToolStats",
    "error_content",
]
# The names `interop.tools` held when it was one module: all of them still read from it.
__getattr__, __dir__ = _lazy_exports(__name__, dict.fromkeys(__all__, "interop.tools.runner"))
