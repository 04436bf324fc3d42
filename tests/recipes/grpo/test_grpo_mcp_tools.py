"""recipes/grpo_torchrl_rm.py with an MCP server as its tool source (``tools.<label>.mcp.servers``): bad servers refused
before any model loads, naming the key (env values never shown); the calculator task trained with the multiply tool
served over MCP (tests/interop/mcp_calculator_server.py), its calls answered; the server's env kept out of the run
folder."""

from __future__ import annotations

import sys

import pytest
from _small_runs import GRPO_SMALL, MCP_MULTIPLY, MCP_SERVER, SMALL_CALCULATOR, read_metrics

import recipes.grpo_torchrl_rm as recipe
from recipes.common.config import ConfigError

pytest.importorskip("mcp")

CALC = "+tools.calc.mcp.servers.calc"
SECRET = "pg://me:pw-5150@db"  # under a name that does not say "secret": masked for being an MCP server's env
SMALL = [*GRPO_SMALL, "train.steps=2", "logger=csv"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [f"{CALC}.command=no-such-mcp-server-4321", f"{CALC}.env.DB_URL={SECRET}"],
            r"tools\.calc\.mcp\.servers\.calc: MCP server 'calc' .*is not found",
        ),
        (
            [
                f"{CALC}.command={sys.executable}",
                f"{CALC}.args=[{MCP_SERVER},--only,'']",
                f"{CALC}.env.DB_URL={SECRET}",
            ],
            r"tools\.calc\.mcp\.servers\.calc: .* lists no tools",
        ),
        (["+tools.calc.mcp.server.command=python"], r"tools\.calc\.mcp: expected \{servers: "),
        ([f"{CALC}.cmd=python", f"{CALC}.env.DB_URL={SECRET}"], r"tools\.calc\.mcp\.servers\.calc: expected \{command"),
        (
            [*MCP_MULTIPLY, f"{CALC}.env.DB_URL=[{SECRET}]"],
            r"tools\.calc\.mcp\.servers\.calc\.env: .*keys \['DB_URL'\]",
        ),
        (
            [*MCP_MULTIPLY, "+tools.multiply.function=recipes.tasks.calculator.multiply"],
            r"tools\.calc\.mcp\.servers\.calc and tools\.multiply\.function both bring a tool named 'multiply'",
        ),
        ([*MCP_MULTIPLY, "+tools.calc.function=x.y"], r"tools\.calc: unknown key\(s\) \['mcp'\]"),
    ],
)
def test_bad_mcp_servers_are_refused_before_any_model_loads(
    compose_config, tmp_path, nothing_loads, overrides, message
):
    with pytest.raises(ConfigError, match=message) as refused:
        recipe.train(compose_config("grpo_torchrl_rm", [*SMALL, f"output_dir={tmp_path}", *overrides]))
    assert SECRET not in str(refused.value)


def test_without_the_mcp_package_the_key_and_the_fix_are_named(compose_config, tmp_path, nothing_loads, monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)  # `import mcp` raises ImportError
    overrides = [*MCP_MULTIPLY, f"{CALC}.env.PROBE=not-listed-before"]  # a server this process never listed
    with pytest.raises(ConfigError, match=r'tools\.calc\.mcp\.servers\.calc: .*pip install "\.\[mcp\]"'):
        recipe.train(compose_config("grpo_torchrl_rm", [*SMALL, f"output_dir={tmp_path}", *overrides]))


def test_the_calculator_task_calls_multiply_over_mcp_and_keeps_the_server_env_out_of_the_run_folder(
    compose_config, tmp_path
):
    """experiment=calculator with its multiply tool served by the MCP server: two steps, the calls answered (tool calls
    logged, no tool error), the server's env value in no file of the run folder."""
    overrides = [
        *SMALL_CALCULATOR,
        "~tools.multiply",
        *MCP_MULTIPLY,
        f"{CALC}.env.DB_URL={SECRET}",
        "train.steps=2",
        f"output_dir={tmp_path}",
    ]
    summary = recipe.train(compose_config("grpo_torchrl_rm", overrides))
    rows = [row for row in read_metrics(tmp_path) if "rollout/turns" in row]
    assert [row["step"] for row in rows] == [1.0, 2.0]
    assert sum(row["rollout/tool_calls_per_dialog"] for row in rows) > 0  # the policy called multiply, over MCP
    assert [row["rollout/tool_errors"] for row in rows] == [0.0, 0.0]
    assert summary["train/steps"] == 2
    leaks = [str(path) for path in tmp_path.rglob("*") if path.is_file() and SECRET.encode() in path.read_bytes()]
    assert not leaks
    assert "DB_URL: <DB_URL>" in (tmp_path / "resolved_config.yaml").read_text()
