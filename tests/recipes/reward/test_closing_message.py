"""The reward recipe's last line: a reward model that ranks held-out pairs no better than chance is never announced as
ready for GRPO (a learning rate of 1e8 trained one with accuracy 0.000 and the run said "Use it in GRPO"), nor one
whose scores do not follow the synthetic task's oracle (docs/lora.md's LoRA command: accuracy 0.694, Spearman -0.046,
announced as ready)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.reward_trainer_from_buffer import closing_message, learned_enough

FIGURES = {"eval/margin_mean": 0.0, "eval/spearman": float("nan")}


@pytest.mark.parametrize("accuracy", [0.0, 0.5, float("nan")])
def test_a_model_at_or_below_chance_is_not_announced_as_ready(accuracy):
    message = closing_message({**FIGURES, "eval/accuracy": accuracy}, Path("run"), learning_rate=1e8)
    assert "Use it in GRPO" not in message and "not ready for GRPO" in message
    assert "train.learning_rate (now 100000000.0)" in message


def test_a_model_that_ranks_pairs_is_announced_with_the_command_that_uses_it():
    message = closing_message({**FIGURES, "eval/accuracy": 0.95}, Path("run"), learning_rate=1e-3)
    assert "Use it in GRPO: python recipes/grpo_torchrl_rm.py reward_model.name_or_path=run/model" in message


@pytest.mark.parametrize("spearman", [-0.046, 0.3])
def test_a_model_above_chance_whose_scores_do_not_follow_the_oracle_is_not_announced_as_ready(spearman):
    summary = {"eval/margin_mean": 1.2, "eval/accuracy": 0.694, "eval/spearman": spearman}
    message = closing_message(summary, Path("run"), learning_rate=3e-3)
    assert "Use it in GRPO" not in message and "barely learned" in message and "not ready for GRPO" in message
    assert f"Spearman vs the oracle {spearman:.3f}" in message and not learned_enough(summary)  # logged as a warning


def test_a_model_that_follows_the_oracle_is_ready():
    summary = {"eval/margin_mean": 1.2, "eval/accuracy": 0.949, "eval/spearman": 0.948}
    assert learned_enough(summary) and "Use it in GRPO" in closing_message(summary, Path("run"), learning_rate=3e-3)
