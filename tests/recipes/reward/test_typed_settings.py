"""The reward recipe reads the typed settings its checks build (``recipes.reward.schema.RewardRecipeConfig``), not the
composed DictConfig: ``validate`` returns the dataclass tree, and the recipe and its room (``recipes/reward/``) read
the raw config only in the places listed here, each with its reason."""

from __future__ import annotations

import pytest
from _typed_settings import (
    EVERY_RECIPES_RECORD_USES,
    ROOT,
    check_raw_config_reads,
    every_recipes_raw_parameters,
    recipe_files,
)
from omegaconf import DictConfig

import recipes.reward_trainer_from_buffer as recipe
from recipes.common.schema import ModelNode, SyntheticData
from recipes.common.validation import ValidatedRun
from recipes.reward.checks import validated
from recipes.reward.schema import Buffer, Eval, Generation, PairKeys, RewardRecipeConfig

FILES = recipe_files("reward_trainer_from_buffer", "reward")

# (file, function, parameter) -> why that parameter is the composed DictConfig, and what it may do with it: pass it to
# the calls named, read the attributes named (".metric").
RAW_CONFIG_PARAMETERS = every_recipes_raw_parameters("reward_trainer_from_buffer", resumes=False)
# The resolved DictConfig kept beside the typed settings (``run_record``) goes only where a DictConfig is the point.
RUN_RECORD_USES = EVERY_RECIPES_RECORD_USES


def test_validate_returns_the_typed_settings_the_run_reads(compose_config, tmp_path):
    cfg = compose_config("reward_trainer_from_buffer", [f"output_dir={tmp_path}", "train.max_steps=7"])
    settings = recipe.validate(cfg)
    assert type(settings) is RewardRecipeConfig
    assert type(settings.buffer) is Buffer and type(settings.buffer.pair_keys) is PairKeys
    assert type(settings.eval) is Eval and type(settings.generation) is Generation
    assert type(settings.reward_model) is ModelNode and type(settings.data) is SyntheticData  # data=synthetic
    # Values are the composed config's, resolved (project_root: an absolute folder) and typed.
    assert settings.buffer.pair_keys.chosen_tokens == list(cfg.buffer.pair_keys.chosen_tokens)
    assert settings.reward_model.name_or_path == str(ROOT / "tiny" / "reward_base")
    assert settings.reward_model.lora is None  # LoRA settled off, as the command line leaves it
    # Open nodes stay plain mappings: train: is trl.RewardConfig's, handed to it whole.
    assert type(settings.train) is dict and settings.train["max_steps"] == 7
    assert type(settings.generation.generate_kwargs) is dict

    # The resolved DictConfig stays beside the settings as the run's record only.
    checked = validated(cfg)  # the one ValidatedRun of recipes.common.validation, as every recipe's
    assert isinstance(checked, ValidatedRun)
    assert checked.settings == settings and isinstance(checked.run_record, DictConfig)
    assert checked.run_record.train.max_steps == 7


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.name)
def test_the_recipe_reads_no_raw_config_outside_the_listed_places(path):
    check_raw_config_reads(
        path,
        raw_parameters=RAW_CONFIG_PARAMETERS,
        run_record_uses=RUN_RECORD_USES,
        settings_class="RewardRecipeConfig",
    )
