"""The GRPO recipes' closing lines give the held-out accuracy of a run that evaluated (the arithmetic and calculator
tasks), beside the reward: the figure those tasks are judged by; and a run whose oracle barely rose says so
(docs/lora.md's first two GRPO commands rose 0.17 / 0.18 in 30 steps and ended on an ordinary closing line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.grpo.report import closing_message as grpo_closing_message
from recipes.trl_grpo.report import closing_message as trl_closing_message

FIGURES = {
    "train/steps": 30,
    "perf/wall_time_s": 12.0,
    "perf/tokens_per_s": 900.0,
    "rollout/reward_mean_first": 0.1,
    "rollout/reward_mean_last": 0.8,
    "rollouts/rows": 64,
    "rollouts/rows_dropped": 0,
}


@pytest.mark.parametrize("closing_message", [grpo_closing_message, trl_closing_message], ids=["grpo", "trl"])
def test_the_closing_line_gives_the_held_out_accuracy_where_the_run_evaluated(closing_message):
    evaluated = closing_message({**FIGURES, "eval/accuracy_first": 0.12, "eval/accuracy_last": 0.64}, Path("run"))
    assert "reward 0.100 -> 0.800, held-out accuracy 0.120 -> 0.640" in evaluated
    assert "held-out accuracy" not in closing_message(FIGURES, Path("run"))


@pytest.mark.parametrize("closing_message", [grpo_closing_message, trl_closing_message], ids=["grpo", "trl"])
def test_the_closing_line_says_when_the_oracle_barely_rose(closing_message):
    start = {**FIGURES, "rollout/oracle_mean_first": -0.052}
    barely = closing_message({**start, "rollout/oracle_mean_last": 0.117}, Path("r"))
    assert "oracle -0.052 -> 0.117" in barely and "The oracle rose only 0.169 in 30 steps" in barely
    assert "barely learned the task" in barely and "docs/lora.md" in barely
    learned = closing_message({**start, "rollout/oracle_mean_last": 0.9}, Path("r"))
    short = {**FIGURES, "train/steps": 2, "rollout/oracle_mean_first": 0.0, "rollout/oracle_mean_last": 0.0}
    assert "barely learned" not in learned and "barely learned" not in closing_message(short, Path("r"))
