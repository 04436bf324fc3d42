"""wandb takes nothing more for a step once it is committed ("Tried to log to step 1 that is less than the current step
2"): the GRPO recipe's sample tables must reach wandb with their step's metrics, not after them."""

from __future__ import annotations

from _small_runs import GRPO_SMALL


class StrictRun:
    """A wandb run that keeps wandb's rule: ``log(step=s)`` after step ``s`` was committed is dropped."""

    def __init__(self):
        self.history: dict[int, dict] = {}
        self.dropped: list[tuple[int, list[str]]] = []
        self.current_step = 0
        self.summary = type("Summary", (), {"update": lambda self, values: None})()

    def log(self, data, step=None, commit=None):
        if step < self.current_step:
            self.dropped.append((step, sorted(data)))
            return
        self.history.setdefault(step, {}).update(data)
        if commit is not False:
            self.current_step = step + 1

    def finish(self):
        pass


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


def test_an_async_run_gives_wandb_the_lag_of_every_trained_batch_as_a_histogram(compose_config, tmp_path, monkeypatch):
    import wandb

    run = _grpo_run_in_strict_wandb(compose_config, tmp_path, monkeypatch, ["rollout.mode=async"])
    lags = [run.history[step]["train/policy_lag"] for step in (1, 2, 3)]
    histograms = [run.history[step]["train/policy_lag_histogram"] for step in (1, 2, 3)]
    assert all(isinstance(histogram, wandb.Histogram) for histogram in histograms)
    # Each step's histogram counts every batch trained so far, at its lag: the first at 0, the later ones at 1.
    assert lags == [0.0, 1.0, 1.0]
    for step, histogram in enumerate(histograms, start=1):
        assert sum(histogram.histogram) == step
        assert histogram.bins[0] <= min(lags[:step]) and histogram.bins[-1] >= max(lags[:step])


def test_the_trl_recipe_gives_wandb_the_lag_of_every_logged_batch_as_a_histogram(compose_config, tmp_path, monkeypatch):
    import wandb
    from _small_runs import TRL_SMALL

    import recipes.trl_grpo_torchrl_rollouts as trl_recipe

    run = StrictRun()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    overrides = [*TRL_SMALL, "rollout.mode=async", "logger=wandb", f"output_dir={tmp_path}"]
    trl_recipe.train(compose_config("trl_grpo_torchrl_rollouts", overrides))
    assert run.dropped == []
    lags = [run.history[step]["train/policy_lag"] for step in (1, 2, 3)]
    for step in (1, 2, 3):
        histogram = run.history[step]["train/policy_lag_histogram"]
        assert sum(histogram.histogram) == step
        assert histogram.bins[0] <= min(lags[:step]) and histogram.bins[-1] >= max(lags[:step])
