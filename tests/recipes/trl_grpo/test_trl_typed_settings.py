"""``recipes/trl_grpo_torchrl_rollouts.py`` and ``recipes/trl_grpo/`` train from ``TrlGRPORecipeConfig``, the dataclass
tree ``recipes.trl_grpo.checks.validate`` returns; Hydra's DictConfig is read only where listed below (with the reason),
and ``tools:`` holds its settings apart from the user's entries (``recipes.common.schema.ToolsNode``)."""

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

import recipes.trl_grpo_torchrl_rollouts as recipe
from recipes.common.schema import LoraNode, ModelNode, RewardFunctionNode, SyntheticData, ToolsNode, checked_tree
from recipes.common.validation import ValidatedRun
from recipes.trl_grpo.checks import validate, validated
from recipes.trl_grpo.schema import Generation, Reward, Rollout, RolloutStore, TrlGRPORecipeConfig

FILES = recipe_files("trl_grpo_torchrl_rollouts", "trl_grpo")

# (file, function, parameter) -> why that parameter is the composed DictConfig, and what it may do with it: pass it to
# the calls named, read the attributes named (".metric").
RAW_CONFIG_PARAMETERS = {
    **every_recipes_raw_parameters("trl_grpo_torchrl_rollouts", resumes=True),
    ("trl_grpo_torchrl_rollouts.py", "_last_checkpoint", "cfg"): (
        "run_recipe names the last checkpoint of an interrupted run from Hydra's config (the run may have been "
        "interrupted before its settings were checked)",
        {".train"},
    ),
    ("resume.py", "resumed_config", "cfg"): (
        "merges the saved resolved_config.yaml with the command line's config, key by key, with OmegaConf",
        {".train", "common_resumed_config"},
    ),
    ("resume.py", "resume_changes", "cfg"): (
        "compares the run's record with the saved resolved_config.yaml, both as the record writes them (secrets "
        "masked)",
        {"common_resume_changes"},
    ),
    ("resume.py", "record_resume_start", "cfg"): (
        "the run's record (resume_changes compares it), and the trainer folder it names",
        {".train", "resume_changes"},
    ),
}
# The resolved DictConfig kept beside the typed settings (``run_record``) goes only where a DictConfig is the point.
RUN_RECORD_USES = {
    **EVERY_RECIPES_RECORD_USES,
    "resume_changes": "a resume's changes, the record against the saved record",
    "record_resume_start": "writes those changes to resumes.jsonl as the resumed run starts",
}


def test_validate_returns_the_typed_settings_the_run_reads(compose_config, tmp_path):
    cfg = compose_config("trl_grpo_torchrl_rollouts", [f"output_dir={tmp_path}", "train.max_steps=7"])
    settings = validate(cfg)
    assert type(settings) is TrlGRPORecipeConfig
    assert type(settings.rollout) is Rollout and type(settings.rollout.generation) is Generation
    assert type(settings.rollout.store) is RolloutStore and type(settings.reward) is Reward
    assert type(settings.model) is ModelNode and type(settings.data) is SyntheticData  # data=synthetic
    assert type(settings.tools) is ToolsNode and settings.tools.entries == {}  # no tools by default
    # Values are the composed config's, resolved (project_root: an absolute folder; ${dtype}) and typed.
    assert settings.model.name_or_path == str(ROOT / "tiny" / "policy")
    assert settings.rollout.sampler_dtype == cfg.dtype and settings.rollout.generation.max_new_tokens == 32
    assert settings.model.lora is None  # LoRA settled off, as the command line leaves it
    # Open nodes stay plain mappings: train: is trl.GRPOConfig's, handed to it whole.
    assert type(settings.train) is dict and settings.train["max_steps"] == 7
    assert type(settings.reward.functions) is dict

    # The resolved DictConfig stays beside the settings as the run's record only.
    checked = validated(cfg)  # the one ValidatedRun of recipes.common.validation, as every recipe's
    assert isinstance(checked, ValidatedRun)
    assert checked.settings == settings and isinstance(checked.run_record, DictConfig)
    assert checked.run_record.train.max_steps == 7


def test_lora_from_the_command_line_is_a_typed_node(compose_config, tmp_path):
    cfg = compose_config("trl_grpo_torchrl_rollouts", [f"output_dir={tmp_path}", "model.lora.r=4"])
    lora = validate(cfg).model.lora
    assert type(lora) is LoraNode and lora.enabled and lora.r == 4


def test_the_tools_node_types_its_settings_and_keeps_the_users_entries_apart(compose_config, tmp_path):
    """``tools:`` mixes the settings of every tool with entries named by the user: the settings are typed fields, the
    entries a mapping of their own (the names are the user's, so no field could hold them)."""
    function = {"function": "recipes.tasks.calculator.multiply"}
    overrides = [f"output_dir={tmp_path}", "tools.timeout_s=3", f"+tools.multiply.function={function['function']}"]
    _, settings = checked_tree(
        compose_config("trl_grpo_torchrl_rollouts", overrides), TrlGRPORecipeConfig, recipe="trl_grpo_torchrl_rollouts"
    )
    assert settings.tools == ToolsNode(timeout_s=3, max_result_tokens=256, entries={"multiply": function})
    # The recipe's rollout function gets the settings and the tool the entry names.
    rollout_func = recipe.make_rollout_func(settings, tokenizer=None)
    assert rollout_func.tool_timeout_s == 3.0 and rollout_func.max_result_tokens == 256
    assert rollout_func.tools.names == ["multiply"]


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.name)
def test_the_recipe_reads_no_raw_config_outside_the_listed_places(path):
    check_raw_config_reads(
        path,
        raw_parameters=RAW_CONFIG_PARAMETERS,
        run_record_uses=RUN_RECORD_USES,
        settings_class="TrlGRPORecipeConfig",
    )


def test_reward_functions_are_typed_nodes(compose_config, tmp_path):
    """Each reward.functions entry is a RewardFunctionNode (the schema's, shared with the GRPO recipe), its weight
    trl's 1.0 where the entry writes none."""
    overrides = [f"output_dir={tmp_path}", "+reward.functions.format.function=trl.rewards.think_format_reward"]
    functions = validate(compose_config("trl_grpo_torchrl_rollouts", overrides)).reward.functions
    assert functions == {"format": RewardFunctionNode("trl.rewards.think_format_reward", 1.0)}
