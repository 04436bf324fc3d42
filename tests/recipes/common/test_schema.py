"""recipes/common/schema.py: a recipe's config is checked and built into its schema's typed nodes once; a node's own
rule (its ``__post_init__``) is refused naming the node's keys in full; a field's Hint gives its refusal its message;
the lists of choices the code acts on are the schema's."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Annotated, Literal

import pytest
from _small_runs import GRPO_SMALL

from recipes.common.config import ConfigError
from recipes.common.schema import (
    ENTRIES,
    Hint,
    LoraNode,
    ModelNode,
    Range,
    SyntheticData,
    ToolsNode,
    WandbLogger,
    checked_tree,
    typed_config,
)
from recipes.grpo.schema import GRPORecipeConfig, Loss, Rollout
from recipes.trl_grpo.schema import TrlGRPORecipeConfig


@dataclass
class _Window:
    low: Annotated[int, Range(ge=0)]
    high: Annotated[int, Range(ge=0), Hint("{key}={value}: the window's end, a step count >= 0 (0: the first).")]
    mode: Literal["fixed", "sliding"]

    def __post_init__(self) -> None:
        if self.high < self.low:
            raise ValueError(f"high={self.high} is below low={self.low}: set high={self.low} or more.")


def test_a_nodes_own_rule_names_its_keys_in_full():
    values = {"low": 3, "high": 1, "mode": "fixed"}
    with pytest.raises(ConfigError) as error:
        typed_config(values, _Window, key="summary.window")
    assert str(error.value) == (
        "summary.window.high=1 is below summary.window.low=3: set summary.window.high=3 or more."
    )
    with pytest.raises(ConfigError, match=r"^high=1 is below low=3"):  # at the root: the node's own names
        typed_config(values, _Window)


def test_a_hint_replaces_the_generic_message_and_a_field_without_one_keeps_it():
    with pytest.raises(ConfigError, match=r"^w.high=-1: the window's end, a step count >= 0 \(0: the first\)\.$"):
        typed_config({"low": 0, "high": -1, "mode": "fixed"}, _Window, key="w")
    with pytest.raises(ConfigError, match=r"^w.low=-1 must be >= 0\.$"):
        typed_config({"low": -1, "high": 0, "mode": "fixed"}, _Window, key="w")
    with pytest.raises(ConfigError, match=r"^w.mode='growing': expected one of \['fixed', 'sliding'\]\.$"):
        typed_config({"low": 0, "high": 0, "mode": "growing"}, _Window, key="w")


@dataclass
class _Shelf:
    capacity: Annotated[int, Range(ge=1)]
    books: Annotated[dict[str, int], ENTRIES]


def test_a_node_with_entries_types_its_settings_and_keeps_every_other_key_as_an_entry():
    """A node that mixes settings with names of the user's own (``tools:``): its settings are checked and built as
    fields, required as any; every other key is an entry, checked against the entries' value type."""
    assert typed_config({"capacity": 2, "atlas": 1, "capacity_x": 3}, _Shelf, key="shelf") == _Shelf(
        capacity=2, books={"atlas": 1, "capacity_x": 3}
    )
    assert typed_config({"capacity": 2}, _Shelf).books == {}
    with pytest.raises(ConfigError, match=r"shelf.capacity is missing: this recipe reads it"):
        typed_config({"atlas": 1}, _Shelf, key="shelf")
    with pytest.raises(ConfigError, match=r"shelf.atlas='one': expected an integer"):
        typed_config({"capacity": 2, "atlas": "one"}, _Shelf, key="shelf")
    with pytest.raises(ConfigError, match=r"shelf.capacity=0 must be >= 1"):
        typed_config({"capacity": 0}, _Shelf, key="shelf")
    # The entries field is no key of the node: a user's entry may take its name.
    assert typed_config({"capacity": 1, "books": 4}, _Shelf).books == {"books": 4}


@pytest.mark.parametrize("recipe", ["grpo_torchrl_rm", "trl_grpo_torchrl_rollouts"])
def test_the_tools_node_keeps_its_settings_as_written_and_its_entries_apart(compose_config, tmp_path, recipe):
    overrides = [f"output_dir={tmp_path}", "+tools.multiply.function=recipes.tasks.calculator.multiply"]
    schema = GRPORecipeConfig if recipe == "grpo_torchrl_rm" else TrlGRPORecipeConfig
    _, settings = checked_tree(compose_config(recipe, overrides), schema, recipe=recipe)
    assert settings.tools == ToolsNode(
        timeout_s=10, max_result_tokens=256, entries={"multiply": {"function": "recipes.tasks.calculator.multiply"}}
    )
    assert type(settings.tools.timeout_s) is int  # as the YAML writes it: a refusal quotes what the user wrote
    with pytest.raises(ConfigError, match=r"tools.timeout_s='soon': expected a number"):
        checked_tree(compose_config(recipe, [*overrides, "tools.timeout_s=soon"]), schema, recipe=recipe)


def test_the_grpo_tree_is_built_with_the_schemas_types(compose_config, tmp_path):
    overrides = [
        *GRPO_SMALL,
        f"output_dir={tmp_path}",
        "loss.clip_epsilon=[0.2,0.28]",
        "logger=wandb",
        "optimizer.lr=1",
    ]
    cfg, tree = checked_tree(compose_config("grpo_torchrl_rm", overrides), GRPORecipeConfig, recipe="grpo_torchrl_rm")
    assert isinstance(tree, GRPORecipeConfig) and isinstance(tree.rollout, Rollout) and isinstance(tree.loss, Loss)
    assert isinstance(tree.model, ModelNode) and tree.model.lora is None  # off: settled as the run trains it
    assert isinstance(tree.data, SyntheticData) and isinstance(tree.logger, WandbLogger)  # the variants picked
    assert (tree.loss.clip_epsilon, tree.loss.clip_epsilon_high) == (0.2, 0.28)  # TorchRL's pair, read as trl's two
    assert type(tree.optimizer.lr) is float and tree.optimizer.betas == [0.9, 0.99]  # optimizer.lr=1 is a float
    assert type(tree.rollout.generation) is dict and tree.rollout.generation["max_new_tokens"] == 8
    assert tree.rollout.group_size == cfg.rollout.group_size == 2  # the tree and the DictConfig agree


def test_lora_settled_on_by_the_command_line_is_a_lora_node(compose_config, tmp_path):
    overrides = [*GRPO_SMALL, f"output_dir={tmp_path}", "model.lora.enabled=true"]
    _, tree = checked_tree(compose_config("grpo_torchrl_rm", overrides), GRPORecipeConfig, recipe="grpo_torchrl_rm")
    assert isinstance(tree.model.lora, LoraNode) and tree.model.lora.enabled and type(tree.model.lora.alpha) is float


@pytest.mark.parametrize(
    ("recipe", "schema_path"),
    [
        ("reward_trainer_from_buffer", "recipes.reward.schema.RewardRecipeConfig"),
        ("trl_grpo_torchrl_rollouts", "recipes.trl_grpo.schema.TrlGRPORecipeConfig"),
    ],
)
def test_every_recipes_defaults_build_into_its_schema(compose_config, tmp_path, recipe, schema_path):
    import importlib

    module, _, name = schema_path.rpartition(".")
    schema = getattr(importlib.import_module(module), name)
    _, tree = checked_tree(compose_config(recipe, [f"output_dir={tmp_path}"]), schema, recipe=recipe)
    assert isinstance(tree, schema) and isinstance(tree.reward_model, ModelNode) and type(tree.train) is dict


def test_the_lists_the_code_acts_on_are_the_schemas():
    from recipes.grpo import distributed, loss, policy, schema

    assert set(loss.POLICY_LOSSES) == set(loss.NORMALIZERS) == set(loss.LOSS_TYPES)
    assert loss.LOSS_TYPES == typing.get_args(schema.LossType)
    assert loss.SCALE_REWARDS == typing.get_args(schema.ScaleRewards)
    assert policy.MIXED_PRECISIONS == typing.get_args(schema.MixedPrecision)
    assert distributed.STRATEGIES == typing.get_args(schema.Strategy)
