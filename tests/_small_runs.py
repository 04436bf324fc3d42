"""What the recipe tests share: overrides that make runs small enough for a test, and reading a run's metrics."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# A GRPO run: 2 prompts x 2 responses of at most 8 tokens per step, scored by the untrained reward base (per process,
# under torchrun).

GRPO_SMALL = [
    "reward_model=tiny_base",
    "rollout.group_size=2",
    "rollout.responses_per_step=4",
    "rollout.generation.max_new_tokens=8",
    "train.mini_batch_size=2",
    # A constant learning rate: the recipe's cosine decays over train.steps, so a 2-step run would not be the first
    # half of a 4-step one, which the resume tests compare.
    "train.lr_scheduler=constant",
    "progress_bar=false",
]

# A reward-model run: 60 prompts, logging every 2 steps.
REWARD_SMALL = ["data.num_train_prompts=48", "data.num_eval_prompts=12", "train.logging_steps=2"]


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The rows of a run's ``metrics.csv`` as numbers; a row holds the figures logged at its step (an evaluation-only
    row, step 0, has no training figures)."""
    with open(run_dir / "metrics.csv", newline="") as handle:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(handle)]


# A trl-rollouts run: 3 steps of 8 completions (2 prompts x 4) of at most 8 tokens, 16 prompts.
TRL_SMALL = [
    "train.max_steps=3",
    "train.per_device_train_batch_size=8",
    "rollout.group_size=4",
    "rollout.generation.max_new_tokens=8",
    "data.num_train_prompts=16",
    "rollout.prompts_per_draw=8",
    "progress_bar=false",
]

# experiment=calculator in small steps, no evaluation: what a resume test or a tool-source test needs.
SMALL_CALCULATOR = [
    "experiment=calculator",
    "rollout.responses_per_step=16",
    "train.mini_batch_size=16",
    "eval.every_n_steps=null",
    "metric=rollout/reward_mean_last",
    "progress_bar=false",
    "logger=csv",
]

# The test suite's MCP server (tests/interop/mcp_calculator_server.py), started with this Python, serving the calculator
# task's multiply only, as tools.calc.mcp.servers.calc.
MCP_SERVER = REPO_ROOT / "tests" / "interop" / "mcp_calculator_server.py"
MCP_CALC = "+tools.calc.mcp.servers.calc"
MCP_MULTIPLY = [f"{MCP_CALC}.command={sys.executable}", f"{MCP_CALC}.args=[{MCP_SERVER},--only,multiply]"]
