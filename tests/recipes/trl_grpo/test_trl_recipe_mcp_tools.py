"""recipes/trl_grpo_torchrl_rollouts.py with an MCP server as its tool source (``tools.<label>.mcp.servers``): a clash
with a function tool refused before any model loads, naming both keys; experiment=calculator trained with the
multiply tool served over MCP (tests/interop/mcp_calculator_server.py), its calls answered."""

from __future__ import annotations

import pytest
from _small_runs import MCP_MULTIPLY, TRL_SMALL, read_metrics

import recipes.trl_grpo_torchrl_rollouts as recipe
from recipes.common.config import ConfigError

pytest.importorskip("mcp")


def test_a_name_clash_with_a_function_tool_is_refused_naming_both_keys(compose_config, tmp_path, monkeypatch):
    loads = []
    monkeypatch.setattr(recipe, "load_causal_lm", lambda *args, **kwargs: loads.append(1))
    clash = [*MCP_MULTIPLY, "+tools.multiply.function=recipes.tasks.calculator.multiply"]
    cfg = compose_config("trl_grpo_torchrl_rollouts", [*TRL_SMALL, f"output_dir={tmp_path / 'run'}", *clash])
    with pytest.raises(ConfigError, match=r"tools\.calc\.mcp\.servers\.calc and tools\.multiply\.function both"):
        recipe.train(cfg)
    assert loads == []


def test_the_calculator_task_calls_multiply_over_mcp(compose_config, tmp_path):
    overrides = [
        "experiment=calculator",
        "~tools.multiply",
        *MCP_MULTIPLY,
        "train.max_steps=2",
        "train.per_device_train_batch_size=16",
        "rollout.group_size=4",
        "rollout.prompts_per_draw=8",
        "eval.every_n_steps=null",
        "metric=rollout/reward_mean_last",
        "logger=csv",
        f"output_dir={tmp_path}",
    ]
    summary = recipe.train(compose_config("trl_grpo_torchrl_rollouts", overrides))
    rows = [row for row in read_metrics(tmp_path) if "rollout/tool_errors" in row]
    assert summary["train/steps"] == 2 and len(rows) == 2
    assert sum(row["rollout/tool_calls_per_dialog"] for row in rows) > 0  # the policy called multiply, over MCP
    assert [row["rollout/tool_errors"] for row in rows] == [0.0, 0.0]
