"""TorchRL's tool pieces (``torchrl.envs.llm.transforms``) as tools of :class:`interop.tools.dialogs.DialogSampler`.

TorchRL 0.14.1 runs tools as env transforms of a ``ChatEnv``, which cannot sample GRPO's multi-turn groups: it refuses
``[prompts, group]`` batches, keeps every row talking until its step limit (a row that answered writes more turns),
and pads the rows that called fewer tools with ``History(role="<none>")`` messages, which the chat template then
renders into the next prompt. So the pieces are taken apart here and their parts handed to the dialog sampler, which
gives them its masks, timeout, error accounting and metrics:

- the *tools* a piece holds become callables a :class:`interop.tools.ToolSet` takes (each with its JSON schema in
  ``json_schema``, made from the TorchRL schema), run by an :class:`interop.tools.ToolRunner` in its worker process;
- the piece's *call format* (its parser, or its regular expression) becomes the ``call_format`` the sampler reads
  each turn's calls with.

Public names:

- :func:`torchrl_tools`: a ``ToolRegistry``, ``ExecuteToolsInOrder``, ``SimpleToolTransform`` or ``PythonInterpreter``
  as :class:`TorchRLTools` (its tools and its call format); anything else refused with the reason.
- :class:`ServiceTool`, :class:`FunctionTool`, :class:`PythonCodeTool`: one TorchRL service, one callable of a
  ``SimpleToolTransform``, TorchRL's Python execution, as a tool.
- :class:`ParserCallFormat` (an ``XMLBlockParser``, a ``JSONCallParser`` or any TorchRL ``LLMToolParser``),
  :class:`PatternCallFormat` (a regular expression capturing the name and the JSON arguments),
  :class:`PythonBlockFormat` (```` ```python ```` blocks, as ``PythonInterpreter`` reads them), and
  :class:`CombinedCallFormat` (several at once): each with ``parse(text) -> interop.tools.ParsedTurn``.

Dependencies: ``torchrl`` (its tool pieces, imported when a piece is adapted or code is run); the standard library.
Every tool runs where the :class:`interop.tools.ToolRunner` runs it (its worker process, which then imports torchrl).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from interop.errors import SettingError
from interop.tools.runner import ParsedTurn, ToolCall, ToolCallFormat

__all__ = [
    "CombinedCallFormat",
    "FunctionTool",
    "ParserCallFormat",
    "PatternCallFormat",
    "PythonBlockFormat",
    "PythonCodeTool",
    "ServiceTool",
    "TorchRLTools",
    "torchrl_tools",
]

# TorchRL's ToolService schemas name Python types ({"a": int}); the chat template shows JSON schema types.
_JSON_TYPE = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
_JSON_TYPE[type(None)] = "null"


def _property(value) -> dict:
    if isinstance(value, type):
        return {"type": _JSON_TYPE[value]} if value in _JSON_TYPE else {}
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str):  # already a JSON type name
        return {"type": value}
    return {}  # a type this cannot express (typing generics...): not checked, the tool checks it


def _function_schema(name: str, description: str, parameters: Mapping) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _parameters(schema_in: Mapping) -> dict:
    """A JSON-schema ``parameters`` object from a TorchRL ``schema_in`` (``{"a": int}``) or a JSON schema."""
    if schema_in.get("type") == "object" and isinstance(schema_in.get("properties"), Mapping):
        return dict(schema_in)
    properties = {str(key): _property(value) for key, value in schema_in.items()}
    return {"type": "object", "properties": properties, "required": list(properties)}


def _description(obj, fallback: str) -> str:
    doc = inspect.getdoc(obj)
    return doc.split("\n\n")[0].strip() if doc else fallback


class ServiceTool:
    """A TorchRL ``ToolService`` (``name``, ``schema_in``, ``__call__(**kwargs) -> dict``) as a tool: called with the
    model's arguments, its result dict written into the tool message (``str(result)``, as trl writes results).

    The service travels to the tool worker pickled, so its class must be importable (defined at a module's top level)
    and its state is the worker's from then on.

    Args:
        service: the service.

    Keyword Args:
        pass_state: add ``_state={}`` to every call, as ``ExecuteToolsInOrder(pass_state_to_tools=True)`` does.
    """

    def __init__(self, service, *, pass_state: bool = False) -> None:
        name = getattr(service, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"ServiceTool: {type(service).__name__} has no name string (a ToolService has one).")
        if not callable(service):
            raise ValueError(f"ServiceTool: service {name!r} ({type(service).__name__}) is not callable.")
        schema_in = getattr(service, "schema_in", None) or {}
        if not isinstance(schema_in, Mapping):
            raise ValueError(f"ServiceTool: service {name!r} has schema_in={schema_in!r}; expected a dict.")
        self.service, self.pass_state, self.__name__ = service, pass_state, name
        self.json_schema = _function_schema(
            name, _description(type(service), f"The {name} tool service."), _parameters(schema_in)
        )

    def __call__(self, **arguments):
        if self.pass_state:
            arguments["_state"] = {}
        return self.service(**arguments)

    def __repr__(self) -> str:
        return f"ServiceTool({self.__name__!r})"


class FunctionTool:
    """One callable of a ``SimpleToolTransform`` (``tools={name: function}``) as a tool named ``name``, its schema
    taken from ``schema`` (``tool_schemas[name]``: a JSON schema of the arguments, or a whole function schema) or else
    from the function's signature and docstring. Its return value is written into the tool message (``str(result)``).

    The function travels to the tool worker pickled by reference: it must be importable by its module and name.
    """

    def __init__(self, name: str, function: Callable, schema: Mapping | None = None) -> None:
        if not callable(function):
            raise ValueError(f"FunctionTool: tool {name!r} is a {type(function).__name__}, not callable.")
        self.function, self.__name__ = function, name
        description = _description(function, f"The {name} tool.")
        if isinstance(schema, Mapping) and "function" in schema:
            self.json_schema = dict(schema)
        elif isinstance(schema, Mapping) and "parameters" in schema:
            self.json_schema = _function_schema(name, schema.get("description", description), schema["parameters"])
        elif isinstance(schema, Mapping) and schema:
            self.json_schema = _function_schema(name, description, _parameters(schema))
        else:
            self.json_schema = _function_schema(name, description, _signature_parameters(function))

    def __call__(self, **arguments):
        return self.function(**arguments)

    def __repr__(self) -> str:
        return f"FunctionTool({self.__name__!r})"


def _signature_parameters(function: Callable) -> dict:
    properties, required = {}, []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        hint = parameter.annotation
        properties[parameter.name] = _property(hint) if hint is not parameter.empty else {}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    return {"type": "object", "properties": properties, "required": required}


_TIMED_OUT = "Code execution timed out"  # PythonInterpreter's stderr when its subprocess ran past its timeout


class PythonCodeTool:
    """TorchRL's Python execution as a tool ``name(code: str)``: each call runs the code in a fresh Python process
    started by ``PythonInterpreter(persistent=False)`` (one process per call: no state shared between calls, so none
    between dialogs), stopped after ``timeout_s``. Answers what the code printed; a code that raised is answered with
    its traceback (an error of kind ``raised``), one stopped at ``timeout_s`` with a timeout (kind ``timeout``).

    The process runs as the training process's user, in its working folder, with its environment variables, its
    network and its files: it is not a sandbox.

    Keyword Args:
        timeout_s: the longest one call's code may run (``PythonInterpreter``'s ``timeout``).
        name: the tool's name, as the model calls it.
    """

    def __init__(self, *, timeout_s: float, name: str = "python") -> None:
        if not timeout_s > 0:
            raise ValueError(f"PythonCodeTool: timeout_s={timeout_s} must be > 0 (seconds).")
        self.timeout_s, self.__name__ = float(timeout_s), name
        self._interpreter: Any = None  # a torchrl PythonInterpreter, built in the tool worker
        parameters = {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python code; print what you want back."}},
            "required": ["code"],
        }
        self.json_schema = _function_schema(
            name, "Runs Python code in a fresh interpreter and returns what it prints.", parameters
        )

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_interpreter": None}  # built where the code runs (the tool worker)

    def __call__(self, code: str) -> str:
        if self._interpreter is None:
            from torchrl.envs.llm.transforms import PythonInterpreter

            self._interpreter = PythonInterpreter(persistent=False, timeout=self.timeout_s)
        result = self._interpreter._execute_python_code(code, 0)
        if result["success"]:
            return result["stdout"]
        if result["stderr"].strip() == _TIMED_OUT:
            raise TimeoutError(f"{self.__name__}: the code ran past {self.timeout_s:g} s and was stopped.")
        raise RuntimeError(result["stderr"].strip() or f"the code exited with code {result['returncode']}")

    def __repr__(self) -> str:
        return f"PythonCodeTool(timeout_s={self.timeout_s:g}, name={self.__name__!r})"


def _turn(text: str, calls: list[ToolCall], first_call: int | None) -> ParsedTurn:
    if not calls:
        return ParsedTurn(text, [])
    return ParsedTurn(text[: first_call if first_call is not None else len(text)].removesuffix("\n"), calls)


def _call(name, arguments, block: str) -> ToolCall:
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, block, f"the call names no tool: {block!r}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return ToolCall(name, None, block, f"the arguments are not valid JSON ({error.msg}): {arguments!r}")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, block, f"the arguments are a {type(arguments).__name__}, not an object")
    return ToolCall(name, arguments, block)


@dataclass(frozen=True)
class ParserCallFormat:
    """A TorchRL ``LLMToolParser`` (``XMLBlockParser``: ``<tool name="add">{"a": 1}</tool>``; ``JSONCallParser``: the
    whole turn a JSON object ``{"message": ..., "tools": [{"tool": ..., "args": {...}}]}``) as the sampler's call
    format. ``close``: the closing marker a turn may stop at (``</tool>`` for an ``XMLBlockParser``), else None."""

    parser: Callable
    close: str | None = None

    def parse(self, text: str) -> ParsedTurn:
        """The calls the parser finds and the text it leaves (the whole turn when it finds none); a parser error
        is one malformed call naming it."""
        try:
            result = self.parser(text)
        except (TypeError, ValueError, KeyError, AttributeError) as error:  # JSONCallParser on an odd object
            return ParsedTurn(text, [ToolCall(None, None, text, f"the calls cannot be read ({error})")])
        calls = [_call(getattr(call, "tool", None), getattr(call, "args", None), text) for call in result["calls"]]
        return ParsedTurn(result["text"] if calls else text, calls)


@dataclass(frozen=True)
class PatternCallFormat:
    """Calls found by a regular expression capturing ``(tool name, JSON arguments)``, as ``SimpleToolTransform`` and
    ``MCPToolTransform`` find them (``<tool>name\\n{...}</tool>`` by default there)."""

    pattern: str
    close: str | None = None

    def __post_init__(self) -> None:
        groups = re.compile(self.pattern, re.DOTALL).groups
        if groups < 2:
            raise ValueError(
                f"PatternCallFormat: pattern {self.pattern!r} captures {groups} group(s); it needs two, the tool's "
                r"name then its JSON arguments, as in r'<tool>(name)\n(arguments)</tool>'."
            )

    def parse(self, text: str) -> ParsedTurn:
        """The turn's calls in this format, in order, and its text before the first call."""
        matches = list(re.finditer(self.pattern, text, re.DOTALL))
        calls = [_call(match.group(1), match.group(2), match.group(0)) for match in matches]
        return _turn(text, calls, matches[0].start() if matches else None)


@dataclass(frozen=True)
class PythonBlockFormat:
    """```` ```python ```` code blocks (``PythonInterpreter``'s pattern), each a call of tool ``tool_name`` with
    ``{"code": <the block>}``."""

    tool_name: str = "python"
    close: str | None = None
    pattern: str = r"```python\n(.*?)\n```"  # torchrl's PythonInterpreter._extract_python_code

    def parse(self, text: str) -> ParsedTurn:
        """The turn's calls in this format, in order, and its text before the first call."""
        matches = list(re.finditer(self.pattern, text, re.DOTALL))
        calls = [ToolCall(self.tool_name, {"code": match.group(1)}, match.group(0)) for match in matches]
        return _turn(text, calls, matches[0].start() if matches else None)


@dataclass(frozen=True)
class CombinedCallFormat:
    """Several call formats read from one turn: their calls one format after the other, the turn's text the part
    before the first call of any. ``close``: the one format's marker when exactly one has a marker, else None."""

    formats: tuple

    @property
    def close(self) -> str | None:
        markers = {fmt.close for fmt in self.formats if fmt.close is not None}
        return markers.pop() if len(markers) == 1 else None

    def parse(self, text: str) -> ParsedTurn:
        """Every format's calls, one format after the other, and the turn's text before the first call of any."""
        parsed = [fmt.parse(text) for fmt in self.formats]
        calls = [call for turn in parsed for call in turn.calls]
        contents = [turn.content for turn in parsed if turn.calls]
        return ParsedTurn(min(contents, key=len) if contents else text, calls)


@dataclass(frozen=True)
class TorchRLTools:
    """What a TorchRL piece brings: ``tools`` (for an :class:`interop.tools.ToolSet`) and the ``call_format`` the
    model's turns are read with."""

    tools: list
    call_format: object


def torchrl_tools(piece) -> TorchRLTools:
    """The tools and the call format of a TorchRL 0.14.1 tool piece.

    - ``ToolRegistry``: its services, called in Qwen2.5's ``<tool_call>`` format (what chat templates render).
    - ``ExecuteToolsInOrder(registry, parser)``: the registry's services, called in the parser's format; every call
      is answered (``stop_on_error`` is not read: a failed call is answered with its error and counted).
    - ``SimpleToolTransform(tools, tool_schemas, parser | tool_call_pattern)``: its callables, in the parser's format
      or its pattern's (its ``timeout`` is not read: the :class:`interop.tools.ToolRunner`'s applies).
    - ``PythonInterpreter(persistent=False)``: a ``python(code)`` tool (:class:`PythonCodeTool` at its ``timeout``),
      called by writing ```` ```python ```` blocks.

    Raises:
        ValueError: ``PythonInterpreter(persistent=True)`` or on Ray services, ``PythonExecutorService`` (a pool of
            persistent interpreters: one dialog's variables would reach another), ``MCPToolTransform`` (use
            :func:`interop.tools.mcp_tools.mcp_tools` on its ``server_configs``), anything else (named, with what is
            accepted).

    Examples:
        >>> from torchrl.envs.llm.transforms import PythonInterpreter
        >>> tools = torchrl_tools(PythonInterpreter(timeout=5.0))
        >>> tools.tools, tools.call_format.parse("Let me.\\n```python\\nprint(6 * 7)\\n```").calls[0].arguments
        ([PythonCodeTool(timeout_s=5, name='python')], {'code': 'print(6 * 7)'})
    """
    from torchrl.envs.llm import transforms as llm

    if isinstance(piece, llm.ToolRegistry):
        return TorchRLTools([ServiceTool(service) for service in _services(piece)], ToolCallFormat())
    if isinstance(piece, llm.ExecuteToolsInOrder):
        tools = [ServiceTool(service, pass_state=piece.pass_state_to_tools) for service in _services(piece.registry)]
        return TorchRLTools(tools, _parser_format(piece.parser))
    if isinstance(piece, llm.SimpleToolTransform):
        functions = [FunctionTool(name, fn, piece.tool_schemas.get(name)) for name, fn in piece.tools.items()]
        fmt = _parser_format(piece.parser) if piece.parser is not None else PatternCallFormat(piece.tool_call_pattern)
        return TorchRLTools(functions, fmt)
    if isinstance(piece, llm.PythonInterpreter):
        if piece.persistent or piece.services is not None:
            raise SettingError(
                "torchrl_tools",
                f"PythonInterpreter(persistent={piece.persistent}, services={piece.services!r}) keeps "
                "interpreters alive across calls, so one dialog's variables would reach another's; use "
                "PythonInterpreter(persistent=False) (a fresh process per call).",
            )
        return TorchRLTools([PythonCodeTool(timeout_s=piece.timeout)], PythonBlockFormat())
    return _refuse(piece, llm)


def _refuse(piece, llm):
    if isinstance(piece, llm.PythonExecutorService):
        raise SettingError(
            "torchrl_tools",
            "PythonExecutorService is a pool of persistent interpreters (a Ray actor's): one dialog's "
            "variables would reach another's. Use PythonInterpreter(persistent=False), which runs each call in a "
            "fresh process.",
        )
    if isinstance(piece, llm.MCPToolTransform):
        raise SettingError(
            "torchrl_tools",
            "MCPToolTransform is not taken apart: it holds live connections to its servers (in a "
            "thread of the process that built it), which the tool worker cannot take over. Build the tools from its "
            "servers instead: interop.tools.mcp_tools.mcp_tools(transform.server_configs) lists them, and each tool "
            "worker starts the servers it calls (their tools are called in Qwen2.5's <tool_call> format).",
        )
    accepted = "ToolRegistry, ExecuteToolsInOrder, SimpleToolTransform, PythonInterpreter"
    raise SettingError(
        "torchrl_tools",
        f"got a {type(piece).__module__}.{type(piece).__qualname__}, not a TorchRL tool piece; "
        f"accepted: {accepted} (torchrl.envs.llm.transforms).",
    )


def _services(registry) -> Sequence:
    # ToolRegistry has get() and `in`, no listing: its services live in _svc (torchrl 0.14.1).
    services = list(getattr(registry, "_svc", {}).values())
    if not services:
        raise SettingError("torchrl_tools", "the ToolRegistry holds no service; register at least one.")
    return services


def _parser_format(parser) -> ParserCallFormat:
    from torchrl.envs.llm.transforms import XMLBlockParser

    return ParserCallFormat(parser, close="</tool>" if isinstance(parser, XMLBlockParser) else None)
