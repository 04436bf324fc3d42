"""The ``tools:`` node: resolved to trl-style tools, every bad entry refused naming its key before a model loads."""

from __future__ import annotations

import sys

import pytest
from omegaconf import OmegaConf

from recipes.common.config import ConfigError
from recipes.common.tools import make_tool_runner, resolve_tools, tool_entries

SETTINGS = {"timeout_s": 5, "max_result_tokens": 16}


def _tools(**entries):
    return OmegaConf.create({**SETTINGS, **entries})


def no_docstring(a: int) -> int:
    return a


def no_hints(a):
    """Returns a.

    Args:
        a: a number.
    """
    return a


def test_resolves_a_dotted_path_and_leaves_the_settings_out():
    tools = _tools(multiply={"function": "recipes.tasks.calculator.multiply"})
    assert list(tool_entries(tools)) == ["multiply"]
    tool_set = resolve_tools(tools)
    assert tool_set.names == ["multiply"]
    assert tool_set.schemas[0]["function"]["parameters"]["required"] == ["a", "b"]


def test_no_tools_is_none():
    assert resolve_tools(OmegaConf.create(SETTINGS)) is None
    assert resolve_tools(None) is None


@pytest.mark.parametrize(
    ("entries", "settings", "message"),
    [
        ({"multiply": "recipes.tasks.calculator.multiply"}, {}, r"tools\.multiply: expected \{function"),
        ({"multiply": {"function": "no_such_module.multiply"}}, {}, r"tools\.multiply\.function=no_such_module"),
        (
            {"multiply": {"function": "recipes.tasks.calculator.TOOLS"}},
            {},
            r"tools\.multiply\.function=.*not a function",
        ),
        ({"no_docstring": {"function": f"{__name__}.no_docstring"}}, {}, r"tools\.no_docstring\.function=.*docstring"),
        ({"no_hints": {"function": f"{__name__}.no_hints"}}, {}, r"tools\.no_hints\.function=.*type hint"),
        ({"times": {"function": "recipes.tasks.calculator.multiply"}}, {}, r"rename the key to tools\.multiply"),
        ({"multiply": {"function": "recipes.tasks.calculator.multiply", "weight": 1}}, {}, r"unknown key"),
        ({"multiply": {"function": "recipes.tasks.calculator.multiply"}}, {"timeout_s": 0}, r"tools\.timeout_s=0"),
        (
            {"multiply": {"function": "recipes.tasks.calculator.multiply"}},
            {"max_result_tokens": 0},
            r"max_result_tokens",
        ),
    ],
)
def test_bad_entries_are_refused_naming_the_key(entries, settings, message):
    with pytest.raises(ConfigError, match=message):
        resolve_tools(OmegaConf.create({**SETTINGS, **settings, **entries}))


def test_the_runner_answers_with_the_settings():
    from transformers import AutoTokenizer

    from interop.tools import ToolCall

    tools = _tools(multiply={"function": "recipes.tasks.calculator.multiply"})
    tokenizer = AutoTokenizer.from_pretrained("tiny/policy")
    with make_tool_runner(tools, resolve_tools(tools), tokenizer=tokenizer) as runner:
        assert (runner.timeout_s, runner.max_result_tokens) == (5.0, 16)
        (result,) = runner.run([ToolCall("multiply", {"a": 12, "b": 34}, "")])
    assert (result.content, result.error) == ("408", None)


def test_an_mcp_servers_start_is_logged_with_its_tools(caplog):
    pytest.importorskip("mcp")
    from _small_runs import MCP_SERVER

    server = {"command": sys.executable, "args": [str(MCP_SERVER), "--only", "multiply,whoami"]}
    server["env"] = {"PROBE": "logged-once"}  # a server this process never listed (listings are kept)
    tools = OmegaConf.create({"timeout_s": 5, "max_result_tokens": None, "calc": {"mcp": {"servers": {"c": server}}}})
    with caplog.at_level("INFO", logger="recipes.common.tools"):
        assert resolve_tools(tools).names == ["multiply", "whoami"]
    assert [record.getMessage() for record in caplog.records] == [
        "tools.calc.mcp.servers.c: MCP server 'c' started and lists 2 tool(s): multiply, whoami (stopped again: each "
        "tool worker starts its own at its start)."
    ]


def test_each_run_lists_its_own_mcp_servers_once(tmp_path):
    """Inside one run (resolving_tools_once, as each recipe's train is wrapped) tools: resolves many times but each
    MCP server starts once to list its tools; a second run in the same process lists them again (no listing kept
    from the run before), and runs with different tools: nodes each get their own tools."""
    pytest.importorskip("mcp")
    from _small_runs import MCP_SERVER

    from recipes.common.tools import resolving_tools_once

    starts = tmp_path / "starts"

    def calc(only: str):
        server = {"command": sys.executable, "args": [str(MCP_SERVER), "--only", only]}
        server["env"] = {"MCP_TEST_STARTS": str(starts)}
        return _tools(calc={"mcp": {"servers": {"c": server}}})

    def started() -> int:
        return len(starts.read_text().split()) if starts.exists() else 0

    with resolving_tools_once():
        assert resolve_tools(calc("multiply")).names == ["multiply"]
        assert resolve_tools(calc("multiply")).names == ["multiply"]  # the checks, the prompts, a policy module...
    assert started() == 1
    with resolving_tools_once():  # the same node, a second run: its own listing
        assert resolve_tools(calc("multiply")).names == ["multiply"]
    assert started() == 2
    with resolving_tools_once():  # another node: its own tools
        assert resolve_tools(calc("multiply,whoami")).names == ["multiply", "whoami"]
    assert started() == 3


@pytest.mark.parametrize(
    "settings",
    [
        {"timeout_s": 0},
        {"timeout_s": -1.5},
        {"timeout_s": float("inf")},
        {"timeout_s": True},
        {"timeout_s": "10"},
        {"max_result_tokens": 0},
        {"max_result_tokens": 1.5},
    ],
)
def test_the_tool_settings_are_checked_once_by_the_runner_that_takes_them(settings):
    """``tools.timeout_s`` and ``tools.max_result_tokens`` are refused in the runner's own words, the key in front:
    one check (``interop.tools.ToolRunner.check_settings``) for the config and for the library's users."""
    from interop.errors import SettingError
    from interop.tools import ToolRunner

    values = {**SETTINGS, **settings}
    with pytest.raises(SettingError) as library:
        ToolRunner.check_settings(**values)
    with pytest.raises(ConfigError) as recipe:
        resolve_tools(OmegaConf.create({**values, "multiply": {"function": "recipes.tasks.calculator.multiply"}}))
    assert library.value.field in settings
    assert str(recipe.value) == f"tools.{library.value.detail}"


def test_the_tool_timeout_has_one_default():
    """The recipes' YAML default (each root config documents it) is the library's: ``ToolRunner`` and
    ``TorchRLRolloutFunc`` default to ``interop.tools.DEFAULT_TIMEOUT_S``, written once."""
    import inspect
    from pathlib import Path

    from interop import TorchRLRolloutFunc
    from interop.tools import DEFAULT_TIMEOUT_S, ToolRunner

    conf = Path(__file__).resolve().parents[3] / "conf"
    for root in ("grpo_torchrl_rm", "trl_grpo_torchrl_rollouts"):
        assert OmegaConf.load(conf / f"{root}.yaml").tools.timeout_s == DEFAULT_TIMEOUT_S, root
    assert inspect.signature(ToolRunner).parameters["timeout_s"].default is DEFAULT_TIMEOUT_S
    assert inspect.signature(TorchRLRolloutFunc).parameters["tool_timeout_s"].default is DEFAULT_TIMEOUT_S
