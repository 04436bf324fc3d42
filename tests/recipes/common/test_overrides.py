"""recipes.common.schema.refuse_unknown_overrides: a key typed without ``+`` that the recipe does not have is answered
with the recipe's key for it (another tool's name) or its nearest keys, before Hydra's bare "not in struct"."""

from __future__ import annotations

import pytest
from _in_process import run_script

from recipes.common.schema import refuse_unknown_overrides
from recipes.grpo.schema import TRL_NAMES, GRPORecipeConfig


@pytest.mark.parametrize(
    ("argument", "answer"),
    [
        ("train.learning_rate=1e-3", "trl.GRPOConfig's learning_rate is optimizer.lr here: set optimizer.lr=1e-3."),
        ("num_generations=4", "trl.GRPOConfig's num_generations is rollout.group_size here: set rollout.group_size=4"),
        ("train.stesp=3", "train.stesp: grpo_torchrl_rm has no such setting, so it would be ignored. Did you mean "),
        ("loss.sapo.temperature_po=1", "Did you mean loss.sapo.temperature_pos"),
    ],
)
def test_an_unknown_key_without_plus_is_answered_with_the_recipes_key(capsys, argument, answer):
    with pytest.raises(SystemExit) as stopped:
        refuse_unknown_overrides(
            ["-m", "seed=0,1", argument], GRPORecipeConfig, recipe="grpo_torchrl_rm", aliases=TRL_NAMES
        )
    assert stopped.value.code == 1 and answer in capsys.readouterr().err


@pytest.mark.parametrize(
    "argument",
    [
        "train.steps=3",
        "model=tiny",
        "experiment=calculator",
        "sweep=grpo_lr_seed",
        "+train.learning_rate=1",
        "hydra.run.dir=x",
        "hydra/launcher=joblib",
        "--cfg",
    ],
)
def test_known_keys_added_keys_groups_and_hydras_own_are_left_to_hydra(argument):
    refuse_unknown_overrides([argument], GRPORecipeConfig, recipe="grpo_torchrl_rm", aliases=TRL_NAMES)


def test_the_trl_recipe_names_its_key_for_a_grpo_config_field_typed_at_the_top_level(capfd):
    """As typed on the trl recipe's command line (its ``__main__``, in this process): its own aliases answer."""
    returncode = run_script("recipes/trl_grpo_torchrl_rollouts.py", "num_generations=4")
    stderr = capfd.readouterr().err
    assert returncode == 1 and "not in struct" not in stderr
    assert "trl.GRPOConfig's num_generations is rollout.group_size here: set rollout.group_size=4" in stderr
