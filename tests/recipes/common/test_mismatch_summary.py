"""The sampler/trainer mismatch in both GRPO recipes' summary.json and closing line: reported, folded over the run's
steps, when the mean |trainer - sampler log-prob| per token is above the documented threshold
(``recipes.common.metrics.SAMPLER_MISMATCH_THRESHOLD``), and absent below it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from recipes.common.metrics import SAMPLER_MISMATCH_THRESHOLD
from recipes.grpo.checkpointing import TrainingProgress
from recipes.grpo.report import closing_message as grpo_closing
from recipes.grpo.report import summarize as grpo_summarize
from recipes.trl_grpo.report import closing_message as trl_closing
from recipes.trl_grpo.report import metric_name
from recipes.trl_grpo.report import summarize as trl_summarize

MEAN, MAX = "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"
CLIPPED = "sampling/importance_sampling_clipped_or_masked/token_fraction"


def _steps(means: list[float]) -> list[dict]:
    """Per-step mismatch figures: the maximum 10x the mean, a tenth of the tokens clipped on the last step."""
    return [
        {MEAN: mean, MAX: 10 * mean, "sampling/sampler_kl_k3": mean**2 / 2, CLIPPED: 0.1 * (step == len(means) - 1)}
        for step, mean in enumerate(means)
    ]


def _grpo(means: list[float]) -> tuple[dict, str]:
    progress = TrainingProgress()
    for figures in _steps(means):
        step = {"rollout/reward_mean": 0.5, "perf/step_time_s": 1.0, "perf/rollout_time_s": 0.5, **figures}
        progress.add_step(step, tokens=100)
    summary = grpo_summarize(progress, window=2, num_processes=1)
    return summary, grpo_closing(summary, Path("run"))


def _trl(means: list[float]) -> tuple[dict, str]:
    # trl's log history: its own names (sampling/* kept by the recipe), one log per step.
    history = [{"loss": 0.1, "reward": 0.5, "step": step + 1, **figures} for step, figures in enumerate(_steps(means))]
    trainer = SimpleNamespace(
        state=SimpleNamespace(log_history=history, global_step=len(history)), args=SimpleNamespace(device="cpu")
    )
    totals = {"rows": 8, "rows_dropped": 0, "tokens": 100}
    summary = trl_summarize(trainer, totals, steps_trained=len(history), tokens=100, train_s=1.0, wall_s=2.0)
    return summary, trl_closing(summary, Path("run"))


@pytest.mark.parametrize("recipe_summary", [_grpo, _trl], ids=["grpo", "trl"])
def test_a_mismatch_above_the_threshold_is_in_the_summary_and_the_closing_line(recipe_summary):
    summary, closing = recipe_summary([0.02, 0.04, 0.03])
    assert summary[MEAN] == pytest.approx(0.03)
    assert summary[MAX] == pytest.approx(0.4), "the largest per-step maximum of the run"
    assert summary[CLIPPED] == pytest.approx(0.1 / 3)
    assert "Sampler/trainer mismatch: |log-prob difference| 0.03 per token" in closing
    assert "3.3% of tokens outside the sampler correction's clip range" in closing


@pytest.mark.parametrize("recipe_summary", [_grpo, _trl], ids=["grpo", "trl"])
def test_a_mismatch_at_or_below_the_threshold_is_left_out(recipe_summary):
    summary, closing = recipe_summary([SAMPLER_MISMATCH_THRESHOLD / 2, SAMPLER_MISMATCH_THRESHOLD])
    assert not any(key.startswith("sampling/") for key in summary)
    assert "mismatch" not in closing


def test_the_trl_recipe_logs_the_mismatch_under_the_grpo_recipes_names():
    assert metric_name(MEAN) == MEAN and metric_name("sampling/sampler_kl_k3") == "sampling/sampler_kl_k3"
