"""``recipes/grpo_torchrl_rm.py`` and ``recipes/grpo/`` train from ``GRPORecipeConfig``, the dataclass tree
``recipes.grpo.checks.validate`` returns (the background collectors get it too, pickled as it is); Hydra's DictConfig
is read only where listed below, with the reason."""

from __future__ import annotations

import pickle

import pytest
from _typed_settings import (
    EVERY_RECIPES_RECORD_USES,
    ROOT,
    check_raw_config_reads,
    every_recipes_raw_parameters,
    recipe_files,
)
from omegaconf import DictConfig

from recipes.common.config import ConfigError
from recipes.common.schema import ModelNode, RewardFunctionNode, SyntheticData, ToolsNode
from recipes.common.validation import ValidatedRun
from recipes.grpo.checks import validate, validated
from recipes.grpo.schema import GRPORecipeConfig, Loss, Optimizer, ReadKeys, Rollout

FILES = recipe_files("grpo_torchrl_rm", "grpo")

# (file, function, parameter) -> why that parameter is a composed DictConfig, and what it may do with it: pass it to
# the calls named, read the attributes named (".metric").
RAW_CONFIG_PARAMETERS = {
    **every_recipes_raw_parameters("grpo_torchrl_rm", resumes=True),
    ("grpo_torchrl_rm.py", "record_resume_changes", "cfg"): (
        "the run's record: what a resume changes, compared with the saved record, and the checkpoint it starts from",
        {"checkpoint_root", "resume_changes"},
    ),
    ("checkpointing.py", "checkpoint_root", "cfg"): (
        "the checkpoints folder of the typed settings or of a composed config (a resume looks for them before the "
        "settings are checked)",
        {".output_dir"},
    ),
    ("checkpointing.py", "resumed_config", "cfg"): (
        "merges the saved resolved_config.yaml with the command line's config, key by key, with OmegaConf",
        {"common_resumed_config", "checkpoint_root"},
    ),
    ("checkpointing.py", "resume_changes", "cfg"): (
        "compares the run's record with the saved resolved_config.yaml, both as the record writes them (secrets "
        "masked)",
        {"common_resume_changes"},
    ),
}
RUN_RECORD_USES = {
    **EVERY_RECIPES_RECORD_USES,
    "resume_changes": "a resume's changes, the record against the saved record",
    "record_resume_changes": "writes those changes to resumes.jsonl as the resumed run starts",
}


def test_validate_returns_the_typed_settings_the_run_reads(compose_config, tmp_path):
    cfg = compose_config("grpo_torchrl_rm", [f"output_dir={tmp_path}", "train.steps=7", "loss.clip_epsilon=[0.2,0.28]"])
    settings = validate(cfg)
    assert type(settings) is GRPORecipeConfig
    assert type(settings.rollout) is Rollout and type(settings.loss) is Loss and type(settings.optimizer) is Optimizer
    assert type(settings.model) is ModelNode and type(settings.data) is SyntheticData  # data=synthetic
    assert type(settings.reward.read_keys) is ReadKeys and type(settings.tools) is ToolsNode
    # Values are the composed config's, resolved (project_root: an absolute folder) and built (the clip pair).
    assert settings.model.name_or_path == str(ROOT / "tiny" / "policy") and settings.train.steps == 7
    assert (settings.loss.clip_epsilon, settings.loss.clip_epsilon_high) == (0.2, 0.28)
    # Open nodes stay plain mappings: the sampler's settings are rollout.env's sampler's.
    assert type(settings.rollout.generation) is dict and settings.rollout.generation["max_new_tokens"] == 32
    assert type(settings.reward.functions) is dict and type(settings.reward.terms) is dict
    # What a collector process gets: the settings themselves, pickled.
    assert pickle.loads(pickle.dumps(settings)) == settings

    # The resolved DictConfig stays beside the settings as the run's record only.
    checked = validated(cfg)  # the one ValidatedRun of recipes.common.validation, as every recipe's
    assert isinstance(checked, ValidatedRun)
    assert checked.settings == settings and isinstance(checked.run_record, DictConfig)
    assert checked.run_record.train.steps == 7 and list(checked.run_record.loss.clip_epsilon) == [0.2, 0.28]


def test_cispo_without_its_upper_bound_is_still_warned_about(compose_config, tmp_path, caplog):
    """The built loss node holds the bound cispo clamps at (clip_epsilon_high, from clip_epsilon when null): the
    warning that it is null comes from the node as the YAML wrote it."""
    validate(compose_config("grpo_torchrl_rm", [f"output_dir={tmp_path}", "loss.type=cispo"]))
    assert "loss.clip_epsilon_high, which is null" in caplog.text
    caplog.clear()
    validate(
        compose_config("grpo_torchrl_rm", [f"output_dir={tmp_path}", "loss.type=cispo", "loss.clip_epsilon_high=1.28"])
    )
    assert "which is null" not in caplog.text


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.name)
def test_the_recipe_reads_no_raw_config_outside_the_listed_places(path):
    check_raw_config_reads(
        path,
        raw_parameters=RAW_CONFIG_PARAMETERS,
        run_record_uses=RUN_RECORD_USES,
        settings_class="GRPORecipeConfig",
    )


def test_reward_functions_are_typed_nodes(compose_config, tmp_path):
    """Each reward.functions entry is a RewardFunctionNode (the schema's, shared with the trl recipe), its weight as
    written (0 stays 0); a misspelt key of an entry is the schema's refusal, naming the key it meant."""
    entry = "+reward.functions.format={function:trl.rewards.think_format_reward,weight:0}"
    functions = validate(compose_config("grpo_torchrl_rm", [f"output_dir={tmp_path}", entry])).reward.functions
    assert functions == {"format": RewardFunctionNode("trl.rewards.think_format_reward", 0)}
    assert type(functions["format"].weight) is int
    misspelt = [f"output_dir={tmp_path}", entry, "+reward.functions.format.wieght=1"]
    with pytest.raises(ConfigError, match=r"reward.functions.format.wieght: .* Did you mean reward.functions.format."):
        validate(compose_config("grpo_torchrl_rm", misspelt))
