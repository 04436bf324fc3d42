"""Tools for multi-turn sampling, written as trl users write them: typed Python functions with a docstring.

Public names:

- :class:`ToolSet`: the tools, their JSON schemas (``transformers.utils.get_json_schema``: what a chat template shows
  when ``tools=`` is passed to ``apply_chat_template``, and what ``trl.GRPOTrainer(tools=...)`` renders) and the
  check of a call's arguments against them. A tool that is not callable, has no docstring or lacks a type hint is
  refused, naming it.
- :class:`ToolCallFormat`: where tool calls sit in a completion's text, ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` by default (Qwen2.5's template; the markers are parameters), and :meth:`ToolCallFormat.parse`.
- :class:`ToolCall`: one call as parsed, or a malformed one with the reason; :class:`ParsedTurn`: a turn's text before
  its calls, and its calls.
- :class:`ToolRunner`: runs calls in a worker process (kept alive across calls; stopped, with every process a tool
  started, and restarted after a call overruns ``timeout_s``; dead with its parent), results cut at
  ``max_result_tokens``. Nothing a tool or a model does makes it raise: a tool that raises, overruns or kills its
  process, a malformed call, an unknown tool or wrong arguments are each answered with an error text as the tool
  message's content (trl's words and form: ``str({"error": ...})``) and counted by kind.
- :class:`ToolResult`: one answered call; :class:`ToolStats`: counts of calls, errors by kind and cut results, per
  dialog or per batch (:meth:`ToolStats.as_metrics` for a logger).

Why a process, not a thread: a thread cannot be stopped, so a tool that hangs would hang the run; a process can be
killed. trl 1.16 calls its tools in the trainer's own process with no timeout.

Dependencies: the standard library; ``transformers`` (``get_json_schema``) when a :class:`ToolSet` is built; the
tokenizer a :class:`ToolRunner` counts result tokens with.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from interop.errors import SettingError

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

# The longest a tool call runs by default, in seconds: ToolRunner's, and TorchRLRolloutFunc's for the tools it runs.
DEFAULT_TIMEOUT_S = 10.0

log = logging.getLogger(__name__)

# What can go wrong with a call, as counted in ToolStats.errors: the tool raised (or answered with text that is not
# valid Unicode), overran its time, killed its process; the call was not parseable, named no known tool, or had
# arguments its schema refuses.
ERROR_KINDS = ("raised", "timeout", "crashed", "malformed", "unknown_tool", "bad_arguments")
_WORKER = Path(__file__).with_name("_tool_worker.py")
# A result is cut to this many characters per allowed token in the worker already, so that a tool returning a huge
# text costs neither the pipe nor the tokenizer; the cut at max_result_tokens tokens then happens here.
_CHARS_PER_TOKEN_BOUND = 32
# How long the worker's keeper may take to kill what the tools started and end, before its process group is killed.
_KEEPER_STOP_S = 10.0
# The most characters of a result read from the worker, whatever max_result_tokens says (None or 10**12 included): a
# model's context holds far fewer tokens, and tokenizing a 50 MB result takes minutes with no progress to show.
MAX_RESULT_CHARS = 1 << 20


def error_content(message: str) -> str:
    """A tool message's content for a failed call, as trl 1.16 writes it (``str({"error": message})``).

    Examples:
        >>> error_content("Tool divide not found.")
        "{'error': 'Tool divide not found.'}"
    """
    return str({"error": message})


class ToolSet:
    """Typed, documented Python functions as tools: their names, JSON schemas, and the check of a call's arguments.

    A tool is what ``trl.GRPOTrainer(tools=[...])`` takes: a function with a type hint on every argument and a
    Google-style docstring describing it and each argument (``Args:``), from which
    ``transformers.utils.get_json_schema`` writes the schema the chat template shows the model. A callable with a
    ``json_schema`` attribute (a function schema, ``{"type": "function", "function": {"name": ...}}``) brings its own
    instead (the adapters of TorchRL's tool pieces, :mod:`interop.tools.torchrl_tools`).

    Args:
        tools: the functions (their ``__name__`` is the tool's name).

    Pickled (to a sampling process), the functions of the script that was run travel by value (``cloudpickle``), as
    that process does not run the script.

    Raises:
        ValueError: a tool that is not callable, has no name, docstring or type hints, or whose docstring does not
            describe an argument (the tool named, with the fix); two tools of one name.

    Examples:
        >>> def add(a: int, b: int) -> int:
        ...     '''Adds two integers.
        ...
        ...     Args:
        ...         a: the first.
        ...         b: the second.
        ...     '''
        ...     return a + b
        >>> tools = ToolSet([add])
        >>> tools.names, tools.schemas[0]["function"]["parameters"]["required"]
        (['add'], ['a', 'b'])
        >>> tools.check_call("add", {"a": 1, "b": "2"})
        ('bad_arguments', "add: argument 'b' must be integer, got str '2'.")
        >>> ToolSet([lambda a: a])
        Traceback (most recent call last):
        ...
        interop.errors.SettingError: ToolSet: tool '<lambda>' has no docstring; ...
    """

    def __init__(self, tools: Iterable[Callable]) -> None:
        self.functions: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        self._parameters: dict[str, dict] = {}
        for index, tool in enumerate(tools):
            name = _tool_name(tool, index)
            if name in self.functions:
                raise SettingError("ToolSet", f"two tools are named {name!r}; tool names must be unique (rename one).")
            schema = _schema(tool, name)
            self.schemas.append(schema)
            self.functions[name] = tool
            self._parameters[name] = schema["function"]["parameters"]

    def __getstate__(self) -> dict:
        # Pickled to a sampling process: the functions of the script that was run travel by value (cloudpickle), as
        # that process does not run the script; the others by reference, as pickle sends them.
        import cloudpickle

        return {**self.__dict__, "functions": cloudpickle.dumps(self.functions)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({**state, "functions": pickle.loads(state["functions"])})

    @property
    def names(self) -> list[str]:
        return list(self.functions)

    def __len__(self) -> int:
        return len(self.functions)

    def __contains__(self, name: object) -> bool:
        return name in self.functions

    def __repr__(self) -> str:
        return f"ToolSet({self.names})"

    def check_call(self, name: str | None, arguments: object) -> tuple[str, str] | None:
        """``None`` when ``name(**arguments)`` fits a tool's schema; else ``(kind, message)``, kind ``unknown_tool`` (in
        trl's words: ``Tool {name} not found.``) or ``bad_arguments`` (unknown or missing names, wrong JSON types)."""
        if name not in self.functions:
            return "unknown_tool", f"Tool {name} not found."
        parameters = self._parameters[name]
        properties = parameters.get("properties", {})
        if not isinstance(arguments, Mapping):
            return "bad_arguments", f"{name}: the arguments must be a JSON object, got {_shown(arguments)}."
        unknown = [key for key in arguments if key not in properties]
        if unknown:
            return "bad_arguments", f"{name}: unexpected argument(s) {unknown}; it takes {list(properties)}."
        missing = [key for key in parameters.get("required", []) if key not in arguments]
        if missing:
            return "bad_arguments", f"{name}: missing argument(s) {missing}."
        for key, value in arguments.items():
            problem = _type_problem(value, properties[key])
            if problem:
                return "bad_arguments", f"{name}: argument {key!r} {problem}."
        return None


def _tool_name(tool, index: int) -> str:
    if not callable(tool):
        raise SettingError(
            "ToolSet",
            f"tool {index} is a {type(tool).__name__} ({_shown(tool)}), not callable; a tool is a function "
            "with type hints and a docstring.",
        )
    name = getattr(tool, "__name__", None)
    if not isinstance(name, str):
        raise SettingError(
            "ToolSet",
            f"tool {index} ({_shown(tool)}) has no __name__, which is the tool's name; wrap it in a named "
            "function (a functools.partial has none).",
        )
    return name


def _schema(tool: Callable, name: str) -> dict:
    import inspect

    explicit = getattr(tool, "json_schema", None)
    if isinstance(explicit, Mapping):  # a tool that brings its schema (interop.tools.torchrl_tools' adapters)
        if explicit.get("function", {}).get("name") != name:
            raise SettingError("ToolSet", f"tool {name!r} brings a json_schema for another name: {_shown(explicit)}.")
        return dict(explicit)

    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    if not inspect.getdoc(tool):
        raise SettingError(
            "ToolSet",
            f"tool {name!r} has no docstring; the model learns what a tool does from it. Write a "
            "Google-style docstring: a description, then 'Args:' with one line per argument.",
        )
    try:
        signature = inspect.signature(tool)
    except (TypeError, ValueError):
        signature = None
    unhinted = [
        parameter.name
        for parameter in (signature.parameters.values() if signature else [])
        if parameter.annotation is inspect.Parameter.empty and parameter.name not in ("self", "cls")
    ]
    if unhinted:
        raise SettingError(
            "ToolSet",
            f"tool {name!r} has no type hint on argument(s) {unhinted}; the JSON schema the model sees is "
            "made from them. Annotate every argument (e.g. `a: int`).",
        )
    try:
        return get_json_schema(tool)
    except (DocstringParsingException, TypeHintParsingException) as error:
        raise SettingError("ToolSet", f"tool {name!r}: {error}") from None


_JSON_TYPES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _type_problem(value, schema: Mapping) -> str | None:
    """What is wrong with ``value`` under a ``get_json_schema`` property schema (``type``, ``enum``, ``nullable``,
    ``items``, ``prefixItems``, ``additionalProperties``, ``anyOf``), or None."""
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        if all(_type_problem(value, option) for option in schema["anyOf"]):
            return f"matches none of {[option.get('type') for option in schema['anyOf']]}, got {_shown(value)}"
        return None
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        known = [kind for kind in kinds if kind in _JSON_TYPES]
        if known and not any(_JSON_TYPES[kind](value) for kind in known):
            return f"must be {' or '.join(known)}, got {type(value).__name__} {_shown(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {schema['enum']}, got {_shown(value)}"
    if isinstance(value, list) and "prefixItems" in schema:
        if len(value) != len(schema["prefixItems"]):
            return f"must hold {len(schema['prefixItems'])} items, got {len(value)}"
        for index, (item, item_schema) in enumerate(zip(value, schema["prefixItems"])):
            problem = _type_problem(item, item_schema)
            if problem:
                return f"item {index} {problem}"
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            problem = _type_problem(item, schema["items"])
            if problem:
                return f"item {index} {problem}"
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), Mapping):
        for key, item in value.items():
            problem = _type_problem(item, schema["additionalProperties"])
            if problem:
                return f"entry {key!r} {problem}"
    return None


def _shown(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass(frozen=True)
class ToolCall:
    """One tool call found in a completion: its ``name`` and ``arguments``, or, when malformed, ``error`` saying why
    (``name`` then as far as it could be read, else None). ``text``: the block as the model wrote it."""

    name: str | None
    arguments: dict | None
    text: str
    error: str | None = None

    @property
    def malformed(self) -> bool:
        return self.error is not None

    def as_message_call(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry (trl's and the chat templates' form)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallFormat:
    """Where tool calls sit in a completion's text: each a JSON object ``{"name": ..., "arguments": {...}}`` between
    ``open`` and ``close`` (Qwen2.5's ``<tool_call>`` and ``</tool_call>``, which its chat template renders and its
    tokenizer holds as single tokens).

    Examples:
        >>> text = 'Let me.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>'
        >>> turn = ToolCallFormat().parse(text)
        >>> turn.content, turn.calls[0].name, turn.calls[0].arguments
        ('Let me.', 'add', {'a': 1})
        >>> ToolCallFormat().parse("<tool_call>{'name': 'add'}</tool_call>").calls[0].error
        'the call is not valid JSON (Expecting property name enclosed in double quotes, column 2): ...'
    """

    open: str = "<tool_call>"
    close: str = "</tool_call>"

    def __post_init__(self) -> None:
        if not self.open or not self.close:
            raise ValueError(
                f"ToolCallFormat: open={self.open!r} and close={self.close!r} must both be non-empty markers."
            )

    def parse(self, text: str) -> ParsedTurn:
        """The turn's text before its first call (one trailing line break dropped, which templates put between
        them) and its calls in order; a block without its closing marker is a malformed call."""
        start = text.find(self.open)
        if start < 0:
            return ParsedTurn(text, [])
        content = text[:start].removesuffix("\n")
        calls = []
        while start >= 0:
            body_start = start + len(self.open)
            end = text.find(self.close, body_start)
            if end < 0:
                block = text[start:]
                calls.append(ToolCall(None, None, block, f"the call has no closing {self.close}"))
                break
            calls.append(_read_call(text[body_start:end], text[start : end + len(self.close)]))
            start = text.find(self.open, end + len(self.close))
        return ParsedTurn(content, calls)


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn's text split as :meth:`ToolCallFormat.parse` reads it."""

    content: str
    calls: list[ToolCall]


def _read_call(body: str, block: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(None, None, block, f"the call is not valid JSON ({error.msg}, column {error.colno}): {body!r}")
    if not isinstance(data, dict):
        return ToolCall(None, None, block, f"the call is a JSON {type(data).__name__}, not an object: {body!r}")
    name = data.get("name")
    if not isinstance(name, str):
        return ToolCall(None, None, block, f'the call has no "name" string: {body!r}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name, None, block, f'the call\'s "arguments" is not a JSON object: {body!r}')
    return ToolCall(name, arguments, block)


@dataclass(frozen=True)
class ToolResult:
    """One answered call: the tool's ``name`` (``"unknown"`` when the call named none), the tool message's
    ``content``, the error kind (one of :data:`ERROR_KINDS`, None when the tool answered), whether the content was
    ``cut`` at the token limit, and the ``seconds`` the call took."""

    name: str
    content: str
    error: str | None = None
    cut: bool = False
    seconds: float = 0.0

    @property
    def message(self) -> dict:
        """The tool message, as trl appends it to a dialog."""
        return {"role": "tool", "name": self.name, "content": self.content}


@dataclass
class ToolStats:
    """Counts over calls: ``calls`` answered, ``errors`` by kind (:data:`ERROR_KINDS`), ``cut_results``.

    Examples:
        >>> stats = ToolStats()
        >>> stats.record(ToolResult("add", "3")); stats.record(ToolResult("add", "{...}", error="timeout"))
        >>> stats.calls, stats.failures, stats.timeouts
        (2, 1, 1)
        >>> (stats + stats).as_metrics()
        {'tools/calls': 4, 'tools/failures': 2, 'tools/cut_results': 0, 'tools/errors/timeout': 2}
    """

    calls: int = 0
    errors: Counter = field(default_factory=Counter)
    cut_results: int = 0

    def record(self, result: ToolResult) -> None:
        """Counts one call: its error kind if it failed, and whether its result was cut."""
        self.calls += 1
        if result.error is not None:
            self.errors[result.error] += 1
        self.cut_results += int(result.cut)

    def __add__(self, other: ToolStats) -> ToolStats:
        return ToolStats(self.calls + other.calls, self.errors + other.errors, self.cut_results + other.cut_results)

    @property
    def failures(self) -> int:
        return sum(self.errors.values())

    @property
    def timeouts(self) -> int:
        return self.errors["timeout"]

    def as_metrics(self, prefix: str = "tools/") -> dict[str, int]:
        """The counts as metric names under ``prefix``: calls, failures, cut results, and one count per error kind."""
        metrics = {f"{prefix}calls": self.calls, f"{prefix}failures": self.failures}
        metrics[f"{prefix}cut_results"] = self.cut_results
        metrics.update({f"{prefix}errors/{kind}": count for kind, count in sorted(self.errors.items())})
        return metrics


class ToolRunner:
    """Runs tool calls in a worker process, answering every call with a tool message's content.

    The worker (a pool of one) starts on the first call and is kept for the next; a call that overruns ``timeout_s``
    is answered with a timeout error and its worker stopped, the next call starting a fresh one. The worker ends on
    :meth:`close` (a ``with`` block closes it) and with this process, however it ends. On Linux every process a tool
    starts ends with the worker, in a session of its own or double-forked too: the worker's keeper process is a child
    subreaper that kills everything below it (``interop/tools/_tool_worker.py`` says what can still escape). Calls run
    one at a time, in order.

    The tools are sent to the worker with ``cloudpickle``: by reference when importable by their module and name (a
    function at a module's top level, or a bound method of an object that pickles; such an object's state lives in the
    worker from then on), by value when defined in the script that was run (``__main__``), which the worker does not
    run (a training script with no ``if __name__ == "__main__":`` guard would train there). A tool with a
    ``start_in_worker()`` method has it called once in each worker, after loading, before the first call, within
    ``start_timeout_s`` (an :class:`interop.tools.mcp_tools.MCPTool` starts its server there); what it returns as text
    is logged (``logging``, INFO).

    Args:
        tools: a :class:`ToolSet`, or the functions to build one from.

    Keyword Args:
        timeout_s: the longest a call may run, in seconds (the worker's start is not counted).
        max_result_tokens: a result (or error text) longer than this many tokens of ``tokenizer`` is cut to them,
            and counted; ``None``: no cut in tokens. Either way a result is read up to :data:`MAX_RESULT_CHARS`
            characters (1 MiB) from the worker, the rest cut (and counted) before any tokenizer sees it.
        tokenizer: counts the result tokens (needed with ``max_result_tokens``).
        start_timeout_s: the longest the worker may take to start and import the tools' modules.

    Examples:
        A tool from a module (``mytools.py``; one defined in the script that runs works the same)::

            >>> from mytools import multiply  # doctest: +SKIP
            >>> with ToolRunner([multiply], timeout_s=5.0, max_result_tokens=None) as runner:  # doctest: +SKIP
            ...     results = runner.run([ToolCall("multiply", {"a": 12, "b": 34}, ""), ToolCall("divide", {}, "")])
            >>> [(result.content, result.error) for result in results]  # doctest: +SKIP
            [('408', None), ("{'error': 'Tool divide not found.'}", 'unknown_tool')]
    """

    def __init__(
        self,
        tools: ToolSet | Iterable[Callable],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_result_tokens: int | None = 512,
        tokenizer=None,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.tools = tools if isinstance(tools, ToolSet) else ToolSet(tools)
        self.check_settings(timeout_s=timeout_s, max_result_tokens=max_result_tokens, start_timeout_s=start_timeout_s)
        if max_result_tokens is not None and tokenizer is None:
            raise ValueError(
                f"ToolRunner: max_result_tokens={max_result_tokens} needs the tokenizer to count tokens with; pass "
                "tokenizer=..., or max_result_tokens=None to never cut results."
            )
        self.timeout_s, self.start_timeout_s = float(timeout_s), float(start_timeout_s)
        self.max_result_tokens, self.tokenizer = max_result_tokens, tokenizer
        self._pickled = _pickled_tools(self.tools)
        self._process: subprocess.Popen | None = None
        self._connection: Connection | None = None
        self._workers_started = 0

    @staticmethod
    def check_settings(*, timeout_s, max_result_tokens, start_timeout_s: float = 120.0) -> None:
        """Refuses settings a runner cannot work with, before one is built (a recipe checks its config with it).

        Raises:
            SettingError: naming the setting (``timeout_s``, ``max_result_tokens``, ``start_timeout_s``).

        Examples:
            >>> ToolRunner.check_settings(timeout_s=0, max_result_tokens=None)
            Traceback (most recent call last):
            ...
            interop.errors.SettingError: ToolRunner: timeout_s=0 must be a finite number of seconds > 0 (a call ...
        """
        for name, seconds in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            # Pipe.poll raises on an infinite wait, and a stuck call would stall the run.
            if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 < float(seconds) < math.inf:
                raise SettingError(
                    "ToolRunner",
                    f"{name}={seconds!r} must be a finite number of seconds > 0 (a call running longer is stopped "
                    "and answered with a timeout error).",
                    field=name,
                )
        if max_result_tokens is not None and (
            isinstance(max_result_tokens, bool)
            or not isinstance(max_result_tokens, numbers.Integral)
            or max_result_tokens < 1
        ):
            raise SettingError(
                "ToolRunner",
                f"max_result_tokens={max_result_tokens!r} must be a whole number of tokens >= 1 (a longer result is "
                "cut to that many), or None (no cut).",
                field="max_result_tokens",
            )

    @property
    def restarts(self) -> int:
        """Workers started after the first (a timeout or a crash ends one; the next call starts another)."""
        return max(self._workers_started - 1, 0)

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the modules close() needs may be gone; the worker dies with us anyway
            pass

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Answers each call, in order (:meth:`run_one`)."""
        return [self.run_one(call) for call in calls]

    def run_one(self, call: ToolCall) -> ToolResult:
        """The answer to one call: the tool's result as text, or an error text (:func:`error_content`) of a kind in
        :data:`ERROR_KINDS`; cut at ``max_result_tokens`` either way. Never raises for what a tool or a model did."""
        start = time.perf_counter()
        name = call.name if call.name is not None else "unknown"
        if call.malformed:
            return self._answer(name, error_content(f"Malformed tool call: {call.error}"), "malformed", start)
        problem = self.tools.check_call(call.name, call.arguments)
        if problem is not None:
            kind, message = problem
            return self._answer(name, error_content(message), kind, start)
        assert call.name is not None and call.arguments is not None  # check_call found the tool and its arguments
        status, payload = self._call_worker(call.name, call.arguments)
        if status == "ok":
            text, cut = payload
            return self._answer(name, text, None, start, cut=cut)
        return self._answer(name, error_content(payload), status, start)

    def _answer(self, name: str, content: str, error: str | None, start: float, *, cut: bool = False) -> ToolResult:
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as bad:  # a lone surrogate: no tokenizer or chat template takes it
            content = error_content(
                f"{name} answered with text that is not valid Unicode ({bad.reason} at character {bad.start}); a "
                "tool must return text that encodes as UTF-8."
            )
            error, cut = "raised", False
        if self.max_result_tokens is not None:
            ids = self.tokenizer(content, add_special_tokens=False, verbose=False)["input_ids"]
            if len(ids) > self.max_result_tokens:
                content = self.tokenizer.decode(ids[: self.max_result_tokens], clean_up_tokenization_spaces=False)
                cut = True
        return ToolResult(name, content, error, cut, time.perf_counter() - start)

    def _call_worker(self, name: str, arguments: dict) -> tuple[str, Any]:
        """``("ok", (text, cut))`` or ``(error kind, message)``."""
        connection = self._worker()
        char_limit = MAX_RESULT_CHARS
        if self.max_result_tokens is not None:
            char_limit = min(char_limit, self.max_result_tokens * _CHARS_PER_TOKEN_BOUND)
        try:
            connection.send((name, arguments, char_limit))
            if not connection.poll(self.timeout_s):
                self._stop_worker()
                return "timeout", f"{name} timed out after {self.timeout_s:g} s."
            status, payload = connection.recv()
        except (EOFError, OSError, BrokenPipeError):
            code = self._stop_worker(wait_s=_KEEPER_STOP_S)  # the keeper ends by itself, with the caller's status
            return "crashed", f"{name}: the tool's process ended (exit code {code}) during the call."
        return status, payload

    def _worker(self):
        if self._connection is not None and self._process is not None and self._process.poll() is None:
            return self._connection
        if self._process is not None:  # ended by itself between calls
            self._stop_worker()
        ours, theirs = Pipe(duplex=True)
        try:
            # PR_SET_PDEATHSIG fires when the thread that started the worker ends: a worker started from a thread
            # that ends is killed then, answered as a crash and restarted by the next call.
            self._process = subprocess.Popen(
                [sys.executable, str(_WORKER), str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a Ctrl-C meant for the run does not reach the worker; it dies with us
            )
        finally:
            theirs.close()
        self._connection = ours
        self._workers_started += 1
        ours.send((list(sys.path), self._pickled))
        if not ours.poll(self.start_timeout_s):
            self._stop_worker()
            raise RuntimeError(
                f"ToolRunner: the tool worker did not start within start_timeout_s={self.start_timeout_s:g} s "
                f"(importing the modules of {self.tools.names}); raise start_timeout_s if they are slow to import."
            )
        status, detail = ours.recv()
        if status != "ready":
            self._stop_worker()
            raise RuntimeError(f"ToolRunner: the tool worker could not load the tools {self.tools.names}:\n{detail}")
        for said in detail:  # what the tools' start_in_worker() said: an MCP server started (or why not)
            log.info("ToolRunner: tool worker %d: %s", self._process.pid, said)
        return ours

    def _stop_worker(self, wait_s: float = 0.0) -> int | None:
        """Ends the worker (if any), everything its tools started with it, and returns its exit code; ``wait_s``: how
        long it may take to end by itself first (its caller process has ended)."""
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if connection is not None:
            connection.close()
        if process is None:
            return None
        if wait_s and process.poll() is None:
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        if process.poll() is None:
            # The keeper kills every process below it (see interop/tools/_tool_worker.py), then ends.
            process.terminate()
            try:
                return process.wait(timeout=_KEEPER_STOP_S)
            except subprocess.TimeoutExpired:
                pass
            try:  # a keeper that did not end: its process group, where all that left no session of its own still is
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                process.kill()
        return process.wait()

    def close(self) -> None:
        """Ends the worker; a later call starts a new one."""
        if getattr(self, "_process", None) is not None or getattr(self, "_connection", None) is not None:
            self._stop_worker()


def _pickled_tools(tools: ToolSet) -> bytes:
    """The tools pickled for the worker: by reference where they are importable (a module's top level), by value
    where they live in the script that was run (``__main__``), so that the worker never runs that script (a trl
    user's training script, unguarded by ``if __name__ == "__main__":``, would train a second time there)."""
    import cloudpickle

    for name, tool in tools.functions.items():
        try:
            if getattr(tool, "__module__", None) != "__main__":
                pickle.dumps(tool)  # importable by its module and name
            cloudpickle.dumps(tool)  # and what a tool of the script that was run uses travels by value
        except Exception as error:
            raise ValueError(
                f"ToolRunner: tool {name!r} cannot be sent to the worker process ({type(error).__name__}: {error}); "
                "a tool must be importable by its module and name: define it at a module's top level (not a lambda "
                "or a function inside a function), or in the script you run, where what it uses must pickle (no "
                "lock, open file or connection among the globals it reads)."
            ) from None
    return cloudpickle.dumps(tools.functions)
