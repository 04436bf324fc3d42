"""recipes/reward/checks.py and schema.py: a key the recipe does not read (trl.RewardConfig's own fields for
``train:``), a wrong type or a non-finite number is refused before anything loads."""

from __future__ import annotations

import pytest
from _small_runs import REWARD_SMALL

import recipes.reward.pairs as preference
import recipes.reward_trainer_from_buffer as recipe
from recipes.common.config import ConfigError


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("nothing may load before the config is validated")

    for module, name in [(recipe, "load_tokenizer"), (recipe, "load_reward_model"), (preference, "load_causal_lm")]:
        monkeypatch.setattr(module, name, refuse)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+train.report_to=wandb", r"train.report_to is set by the recipe .*use logger=wandb"),
        (
            "+train.gradient_acumulation_steps=2",
            r"train.gradient_acumulation_steps: trl.RewardConfig has no such field"
            r".*Did you mean train.gradient_accumulation_steps",
        ),
        ("+eval.holdout=0.2", r"eval.holdout: reward_trainer_from_buffer has no such setting.*eval.holdout_fraction"),
        ("+generation.temperature=0.7", r"generation.temperature: .*no such setting"),
        ("generation.generate_kwargs.temperature=nan", r"generation.generate_kwargs.temperature=nan: not a finite"),
        ("train.learning_rate=nan", r"train.learning_rate=nan: not a finite number"),
        ("reward_model.lora.alpha=true", r"reward_model.lora.alpha=True: expected a number"),
        ("seed=-1", r"seed=-1 must be >= 0"),
        ("data=arithmetic", r"data=arithmetic is a GRPO task .* no preference pairs .* Use data=synthetic"),
        ("data=calculator", r"data=calculator is a GRPO task .* no preference pairs .* Use data=synthetic"),
        ("buffer.storage=ram", r"^buffer.storage='ram': expected one of \['lazy_tensor', 'memmap'\] \(buffer=memmap"),
    ],
)
def test_bad_keys_and_values_are_refused_before_anything_loads(
    compose_config, tmp_path, nothing_loads, override, message
):
    cfg = compose_config("reward_trainer_from_buffer", [*REWARD_SMALL, f"output_dir={tmp_path}", override])
    with pytest.raises(ConfigError, match=message):
        recipe.train(cfg)


def test_a_memmap_buffer_without_a_folder_is_refused_by_its_node_naming_its_keys(
    compose_config, tmp_path, nothing_loads
):
    cfg = compose_config(
        "reward_trainer_from_buffer", [*REWARD_SMALL, f"output_dir={tmp_path}", "buffer=memmap", "buffer.path=null"]
    )
    with pytest.raises(
        ConfigError, match=r"^buffer.storage=memmap writes its pairs to a folder, but buffer.path=null: "
    ):
        recipe.train(cfg)


def test_a_learning_rate_that_blows_up_stops_training_and_saves_nothing(compose_config, tmp_path):
    """train.learning_rate=1e8 used to exit 0 with NaN weights saved as model/ and NaN in summary.json."""
    from recipes.common.config import RunStopped

    overrides = [*REWARD_SMALL, "train.max_steps=6", "train.learning_rate=1e8", f"output_dir={tmp_path}"]
    with pytest.raises(
        RunStopped, match=r"Training stopped at .*non-finite.* none is saved. Lower train.learning_rate"
    ):
        recipe.train(compose_config("reward_trainer_from_buffer", overrides))
    assert not (tmp_path / "model").exists() and not (tmp_path / "summary.json").exists()


def test_trl_evaluations_during_training_reach_the_run_logger(compose_config, tmp_path):
    import csv

    overrides = [*REWARD_SMALL, "train.max_steps=4", "train.eval_strategy=steps", "train.eval_steps=2", "logger=csv"]
    recipe.train(compose_config("reward_trainer_from_buffer", [*overrides, f"output_dir={tmp_path}"]))
    with open(tmp_path / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("eval/loss")]
    assert [float(row["step"]) for row in rows] == [2.0, 4.0]
    assert all(0.0 <= float(row["eval/accuracy"]) <= 1.0 for row in rows)


def test_a_bad_labeler_setting_is_refused_before_any_model_loads(compose_config, tmp_path, monkeypatch):
    import recipes.reward_trainer_from_buffer as recipe

    monkeypatch.setattr(recipe, "load_sampling_policy", pytest.fail)
    cfg = compose_config(
        "reward_trainer_from_buffer", ["labeler.corrupted_pairs_per_prompt=-1", f"output_dir={tmp_path}"]
    )
    with pytest.raises(ConfigError, match=r"labeler: .*corrupted_pairs_per_prompt must be >= 0, got -1"):
        recipe.train(cfg)
