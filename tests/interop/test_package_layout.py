"""The library's layout in wings (interop.sampling, interop.tools, interop.trl): every name a user imported from the
flat layout still imports, as the very same object; the moved module paths warn, naming the new one; the light
entry points of child processes stay light."""

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import interop

# The module paths of the flat layout that moved, and where their code lives now (written out here, not read from
# interop._exports, so that dropping one from the library fails this test).
MOVED = {
    "interop.background_sampler": "interop.sampling.background",
    "interop.dialog_policy": "interop.tools.dialog_policy",
    "interop.dialogs": "interop.tools.dialogs",
    "interop.group_replay": "interop.trl.group_replay",
    "interop.importance_sampling": "interop.trl.importance_sampling",
    "interop.mcp_tools": "interop.tools.mcp_tools",
    "interop.rollout_func": "interop.trl.rollout_func",
    "interop.rollout_workers": "interop.sampling.workers",
    "interop.torchrl_tools": "interop.tools.torchrl_tools",
    "interop.trl_grpo": "interop.trl.trainer",
}
# What `interop.sampling` and `interop.tools` exported when each was one module (their __all__ and the TensorDict
# keys the recipes read): the packages they became export each, the module's own object.
FLAT_SAMPLING = [
    "ATTENTION_MASK",
    "CausalLMSampler",
    "KeptCache",
    "LOG_PROBS",
    "POLICY_VERSION",
    "PROMPT_MASK",
    "PROMPT_TOKENS",
    "RESPONSE_TOKENS",
    "SampledResponses",
    "SamplingSettings",
    "TOKENS",
    "TRUNCATED",
    "check_pad_token",
    "end_of_response_ids",
    "sample_responses",
]
FLAT_TOOLS = [
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


def _fresh_import(name: str):
    """Imports ``name`` as a first import would (its warnings recorded), whatever this process imported before, and
    puts the module this process had back: a fresh package object lacks the attributes that its submodules, loaded
    before and still in ``sys.modules``, set on the old one (``interop.sampling.sampler``), and the tests that run
    next in this process resolve such dotted paths (monkeypatch.setattr("interop.sampling.sampler._X", ...))."""
    parent, _, child = name.rpartition(".")
    saved_module = sys.modules.pop(name, None)
    saved_attribute = vars(sys.modules[parent]).get(child, _MISSING)
    if saved_attribute is not _MISSING:
        delattr(sys.modules[parent], child)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(f"import {name}", __file__, "exec"), {})  # an import statement, in this file
        fresh = sys.modules[name]
    finally:
        if saved_module is not None:
            sys.modules[name] = saved_module
        if saved_attribute is not _MISSING:
            setattr(sys.modules[parent], child, saved_attribute)
    return fresh, [warning for warning in caught if issubclass(warning.category, DeprecationWarning)]


_MISSING = object()


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_path_gives_the_new_module_and_warns_naming_it(old):
    new = importlib.import_module(MOVED[old])
    module, deprecations = _fresh_import(old)
    assert module is new
    assert [str(warning.message) for warning in deprecations if old in str(warning.message)], deprecations
    assert all(MOVED[old] in str(warning.message) for warning in deprecations)
    assert deprecations[0].filename == __file__  # pointed at the line that imported the old path
    for name in new.__all__:
        assert getattr(module, name) is getattr(new, name)
    exec(f"from {old} import {', '.join(new.__all__)}", namespace := {})
    assert all(namespace[name] is getattr(new, name) for name in new.__all__)
    exec(f"from interop import {old.rpartition('.')[2]} as submodule", namespace)
    assert namespace["submodule"] is new


@pytest.mark.parametrize(
    ("package", "module", "names"),
    [
        ("interop.sampling", "interop.sampling.sampler", FLAT_SAMPLING),
        ("interop.tools", "interop.tools.runner", FLAT_TOOLS),
    ],
)
def test_a_module_that_became_a_package_exports_its_names_without_a_warning(package, module, names):
    _, deprecations = _fresh_import(package)
    assert not deprecations
    package_module, defining = importlib.import_module(package), importlib.import_module(module)
    for name in names:
        assert getattr(package_module, name) is getattr(defining, name), name
    assert set(names) <= set(package_module.__all__) and set(names) <= set(dir(package_module))


def test_every_name_of_interop_is_its_module_s_own_object():
    for name in interop.__all__:
        value = getattr(interop, name)
        assert value is getattr(importlib.import_module(value.__module__), name)
    assert {"sampling", "tools", "trl"} <= {name for name in dir(interop)} | set(sys.modules["interop"].__dict__)
    with pytest.raises(AttributeError, match="no attribute 'rollout_func_typo'"):
        interop.rollout_func_typo  # noqa: B018


def test_the_entry_points_of_child_processes_import_no_torch():
    """A sampler child sets PR_SET_PDEATHSIG before its heavy imports (a fork server too, from the first module it
    imports), and a tool worker restarted after a timeout pays its imports again: their modules, and the wing packages
    Python runs first, must not import torch or trl."""
    light = [
        "interop.sampling._child",
        "interop.sampling._fork_server_guard",
        "interop.sampling.child_processes",
        "interop.sampling._ray_janitor",
        "interop.tools",
        "interop.tools.runner",
        "interop.tools.mcp_tools",
        "interop.trl",
    ]
    heavy = ["torch", "transformers", "trl"]
    code = f"import sys\nfor name in {light!r}: __import__(name)\nprint([n for n in {heavy!r} if n in sys.modules])"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert result.stdout.strip() == "[]", result.stdout


INTEROP = Path(__file__).resolve().parents[2] / "interop"
# The one cycle the library keeps on purpose: a spawned sampler child's entry module (interop.sampling._child) sets
# PR_SET_PDEATHSIG before it imports the sampler it serves (interop.sampling.background), which names the entry as
# its process target.
SPAWN_ENTRY_EDGES = {("interop.sampling._child", "interop.sampling.background")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(INTEROP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_at_run_time(tree: ast.Module) -> list[str]:
    """Every module an import statement names, at module level or inside a function (imported when it runs), except
    under ``if TYPE_CHECKING:`` (never run); ``from a import b`` names ``a.b`` where that is a module, else ``a``."""
    checked_types = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for child in ast.walk(statement)
    }
    names = []
    for node in ast.walk(tree):
        if id(node) in checked_types:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
    return names


def _import_graph() -> dict[str, set[str]]:
    """interop's modules and the interop modules each one imports when it runs (a module's parent packages too:
    Python runs their ``__init__`` first)."""
    modules = {_module_name(path): path for path in INTEROP.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports_at_run_time(ast.parse(path.read_text())):
            parts = imported.split(".")
            targets |= {".".join(parts[:n]) for n in range(1, len(parts) + 1)} & modules.keys()
        graph[name] = targets - {name} - set(_parents(name))
    return graph


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_interop_modules_but_the_spawn_entry():
    graph = _import_graph()
    assert "interop.sampling.background" in graph["interop.sampling._child"]  # the entry is seen, and allowed
    for source, target in SPAWN_ENTRY_EDGES:
        graph[source].discard(target)
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MAX_FUNCTION_LINES = 80


def test_no_function_in_interop_is_longer_than_80_lines():
    """Every function and method of interop/, counted from its ``def`` line (decorators not counted) to its last line,
    signature and docstring included: ``end_lineno - lineno + 1 <= 80``."""
    long = []
    for path in sorted(INTEROP.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(INTEROP.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
