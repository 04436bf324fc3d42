"""One vocabulary for the two GRPO recipes: a concept both have is set by the same key in both, and reaches the same
effect (the GRPO recipe's sampler settings; the ``trl.GRPOConfig`` field the trl recipe's trainer gets); the trl
recipe's old names for them (trl's ``GRPOConfig`` fields under ``train:``) are refused naming the new key, before any
model loads. Nothing trains here: the configs are composed, checked and turned into what the recipes build from them.
"""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

import recipes.trl_grpo_torchrl_rollouts as trl_recipe
from recipes.common.config import ConfigError
from recipes.common.data import PromptRows
from recipes.common.models import load_tokenizer
from recipes.common.sampling import sampler_settings
from recipes.common.schema import refuse_unknown_overrides
from recipes.grpo.checks import validate as validate_grpo
from recipes.grpo.collector import make_prompt_table as grpo_prompt_table
from recipes.trl_grpo.checks import validate as validate_trl
from recipes.trl_grpo.schema import GRPO_CONFIG_FIELDS, RENAMED, TrlGRPORecipeConfig

GRPO, TRL = "grpo_torchrl_rm", "trl_grpo_torchrl_rollouts"

# Every concept both recipes have: its one key, and the trl recipe's key for it before (None: it was the same already).
# docs/configuration.md#one-vocabulary-for-both-grpo-recipes is this table for readers.
SHARED = {
    "rollout.group_size": "train.num_generations",
    "rollout.generation.max_new_tokens": "train.max_completion_length",
    "rollout.generation.min_new_tokens": "train.generation_kwargs.min_new_tokens",
    "rollout.generation.do_sample": "train.generation_kwargs.do_sample",
    "rollout.generation.temperature": "train.temperature",
    "rollout.generation.top_k": "train.top_k",
    "rollout.generation.top_p": "train.top_p",
    "rollout.generation.min_p": "train.min_p",
    "rollout.generation.repetition_penalty": "train.repetition_penalty",
    "rollout.system_prompt": "system_prompt",
    "rollout.collector_threads": "rollout.sampler_threads",
    "progress_bar": "train.disable_tqdm",
    "reward.aggregation": "train.multi_objective_aggregation",
    "reward.model_weight": None,
    "reward.functions": None,
    "rollout.mode": None,
    "rollout.max_policy_lag": None,
    "rollout.past_lag_bound": None,
    "rollout.backend": None,
    "rollout.workers": None,
    "rollout.worker_resources": None,
    "rollout.weight_sync_every": None,
    "rollout.sampler_dtype": None,
    "rollout.max_turns": None,
    "tools.timeout_s": None,
    "tools.max_result_tokens": None,
    "eval.every_n_steps": None,
    "eval.num_prompts": None,
    "eval.accuracy_source": None,
    "data": None,
    "ray.address": None,
    "ray.num_cpus": None,
}

# A value other than the default for each sampler setting (both recipes default to the same values).
SAMPLING = {
    "max_new_tokens": 12,
    "min_new_tokens": 2,
    "temperature": 0.7,
    "top_k": 7,
    "top_p": 0.9,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
}


def _checked(compose_config, root: str, tmp_path, overrides: list[str]):
    cfg = compose_config(root, [*overrides, f"output_dir={tmp_path / root}"])
    return (validate_grpo if root == GRPO else validate_trl)(cfg)


@pytest.mark.parametrize("root", [GRPO, TRL])
def test_every_shared_concept_has_its_one_key_in_both_recipes_and_the_old_one_in_neither(compose_config, root):
    cfg = compose_config(root)
    for key, old in SHARED.items():
        assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>", f"{root} has no {key}"
        if old is not None:
            assert OmegaConf.select(cfg, old, default="<missing>") == "<missing>", f"{root} still has {old}"
    # Both recipes start from the same values of the shared settings they default alike.
    grpo, trl = compose_config(GRPO), compose_config(TRL)
    for key in (
        "rollout.group_size",
        "rollout.generation",
        "rollout.system_prompt",
        "progress_bar",
        "reward.aggregation",
    ):
        assert OmegaConf.select(grpo, key) == OmegaConf.select(trl, key), key


@pytest.mark.parametrize(("name", "value"), SAMPLING.items())
def test_a_sampler_setting_reaches_both_recipes_samplers_under_one_key(compose_config, tmp_path, name, value):
    """The same override gives the GRPO recipe's sampler and the trl recipe's (which reads trl's GRPOConfig back)
    the same settings, the overridden one at its new value."""
    overrides = [f"rollout.generation.{name}={value}"]
    grpo = sampler_settings(_checked(compose_config, GRPO, tmp_path, overrides).rollout.generation)
    trl_cfg = _checked(compose_config, TRL, tmp_path, overrides)
    args = trl_recipe.make_grpo_config(trl_cfg)
    from interop.sampling import SamplingSettings

    trl = SamplingSettings.from_grpo_config(args)
    assert getattr(grpo, name) == value == getattr(trl, name)
    assert grpo.differences(trl) == {}


@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ("rollout.group_size=4", "num_generations", 4),
        ("rollout.generation.max_new_tokens=12", "max_completion_length", 12),
        ("rollout.generation.temperature=0.7", "temperature", 0.7),
        ("rollout.generation.do_sample=true", "generation_kwargs", {"min_new_tokens": 0, "do_sample": True}),
        ("reward.aggregation=normalize_then_sum", "multi_objective_aggregation", "normalize_then_sum"),
        ("progress_bar=false", "disable_tqdm", True),
        ("progress_bar=true", "disable_tqdm", False),
    ],
)
def test_the_trl_recipe_hands_trl_the_grpo_config_field_of_each_shared_key(
    compose_config, tmp_path, override, field, expected
):
    """The key the GRPO recipe reads is accepted by both, and the trl recipe's trainer gets it as trl's field."""
    _checked(compose_config, GRPO, tmp_path, [override])
    args = trl_recipe.make_grpo_config(_checked(compose_config, TRL, tmp_path, [override]))
    assert getattr(args, field) == expected


def test_the_system_prompt_opens_every_prompt_in_both_recipes(compose_config, tmp_path):
    override = ["rollout.system_prompt=Answer briefly."]
    rows = PromptRows(["Review the lamp."], {})
    tables = []
    for root, make in ((GRPO, grpo_prompt_table), (TRL, trl_recipe.make_prompt_table)):
        cfg = _checked(compose_config, root, tmp_path, override)
        tables.append(make(cfg, rows, load_tokenizer(cfg.model, padding_side="left")))
    expected = {"role": "system", "content": "Answer briefly."}
    assert [table.conversations[0][0] for table in tables] == [expected, expected]


def test_the_rollout_workers_threads_are_one_key(compose_config, tmp_path):
    cfg = _checked(compose_config, TRL, tmp_path, ["rollout.collector_threads=3"])
    rollout_func = trl_recipe.make_rollout_func(cfg, load_tokenizer(cfg.model, padding_side="left"))
    assert rollout_func.sampler_threads == 3
    assert _checked(compose_config, GRPO, tmp_path, ["rollout.collector_threads=3"]).rollout.collector_threads == 3


@pytest.mark.parametrize(("old", "new"), [(old, new) for new, old in SHARED.items() if old is not None])
def test_the_trl_recipes_old_names_are_refused_naming_the_new_key(compose_config, tmp_path, monkeypatch, old, new):
    """Written into the config (``+train.temperature=0.7``), refused by the checks before any model loads; typed on
    the command line (``train.temperature=0.7``), refused before Hydra composes, naming the key either way."""
    loads = []
    monkeypatch.setattr(trl_recipe, "load_causal_lm", lambda *args, **kwargs: loads.append(1))
    value = "true" if old == "train.disable_tqdm" else "4" if "threads" in old or "num_gen" in old else "0.5"
    old_key = old.rsplit(".", 1)[0] if old.startswith("train.generation_kwargs") else old  # one entry for both
    named = RENAMED[old_key].split()[0]  # the new key (the node, for generation_kwargs)
    assert named in (new, new.rsplit(".", 1)[0])
    cfg = compose_config(TRL, [f"+{old}={value}", f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=rf"^{re.escape(old_key)} is gone from {TRL}: use {re.escape(named)}\b"):
        trl_recipe.train(cfg)
    assert loads == []


@pytest.mark.parametrize(
    ("argument", "answer"),
    [
        (
            "train.temperature=0.7",
            "train.temperature is gone from trl_grpo_torchrl_rollouts: use rollout.generation.temperature=0.7.",
        ),
        ("train.num_generations=4", "use rollout.group_size=4."),
        ("+train.max_completion_length=64", "use rollout.generation.max_new_tokens=64."),
        ("system_prompt=Be brief.", "use rollout.system_prompt=Be brief."),
        ("train.disable_tqdm=false", "use progress_bar (its opposite: disable_tqdm=true is progress_bar=false)."),
        (
            "temperature=0.7",
            "trl.GRPOConfig's temperature is rollout.generation.temperature here: set "
            "rollout.generation.temperature=0.7",
        ),
        ("num_generations=4", "trl.GRPOConfig's num_generations is rollout.group_size here"),
        ("learning_rate=1e-3", "trl.GRPOConfig's learning_rate is train.learning_rate here"),
    ],
)
def test_the_trl_recipes_command_line_names_the_new_key(capsys, argument, answer):
    with pytest.raises(SystemExit) as stopped:
        refuse_unknown_overrides(
            [argument], TrlGRPORecipeConfig, recipe=TRL, aliases=trl_recipe._trl_names, renamed=RENAMED
        )
    assert stopped.value.code == 1 and answer in capsys.readouterr().err


def test_every_grpo_config_field_the_trl_recipe_sets_is_refused_under_train():
    """A GRPOConfig field set from the recipe's own keys, written under ``train:``, would be overridden: refused."""
    assert {f"train.{field}" for field in GRPO_CONFIG_FIELDS} <= set(RENAMED)
