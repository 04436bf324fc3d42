"""wandb takes nothing more for a step once it is committed ("Tried to log to step 1 that is less than the current step
2"): the GRPO recipe's sample tables must reach wandb with their step's metrics, not after them. What an async run
gives wandb (train/policy_lag_histogram, every batch trained so far at its lag) is read from the async tests' own runs,
which log to a :class:`~_wandb_run.StrictRun`: tests/recipes/test_grpo_async.py
(test_the_policy_lag_stays_within_its_bound_and_what_reward_functions_log_travels_with_the_batch) and
tests/recipes/trl_grpo/test_async_and_replay.py (test_an_async_run_trains_each_batch_one_update_behind_and_logs_it)."""

from __future__ import annotations

from _small_runs import GRPO_SMALL
from _wandb_run import StrictRun


def _grpo_run_in_strict_wandb(compose_config, tmp_path, monkeypatch, overrides: list[str]) -> StrictRun:
    """A 3-step GRPO run logging to a :class:`StrictRun`; it asserts that wandb dropped nothing."""
    import wandb

    import recipes.grpo_torchrl_rm as recipe

    run = StrictRun()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    overrides = [*GRPO_SMALL, "train.steps=3", "logger=wandb", f"output_dir={tmp_path}", *overrides]
    recipe.train(compose_config("grpo_torchrl_rm", overrides))
    assert run.dropped == []
    return run


def test_every_sample_table_reaches_wandb_with_its_step(compose_config, tmp_path, monkeypatch):
    run = _grpo_run_in_strict_wandb(compose_config, tmp_path, monkeypatch, ["samples.every_n_steps=1"])
    assert [step for step in sorted(run.history) if "samples" in run.history[step]] == [1, 2, 3]
    assert all("rollout/reward_mean" in run.history[step] for step in (1, 2, 3))
