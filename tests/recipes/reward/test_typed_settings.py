"""The reward recipe reads the typed settings its checks build (``recipes.reward.schema.RewardRecipeConfig``), not the
composed DictConfig: ``validate`` returns the dataclass tree, and the recipe and its room (``recipes/reward/``) read
the raw config only in the places listed here, each with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from omegaconf import DictConfig

import recipes.reward_trainer_from_buffer as recipe
from recipes.common.schema import ModelNode, SyntheticData
from recipes.reward.checks import validated
from recipes.reward.schema import Buffer, Eval, Generation, PairKeys, RewardRecipeConfig

ROOT = Path(__file__).resolve().parents[3]
FILES = [ROOT / "recipes" / "reward_trainer_from_buffer.py", *sorted((ROOT / "recipes" / "reward").glob("*.py"))]

# (file, function, parameter) -> why that parameter is the composed DictConfig, and what it may do with it: pass it to
# the calls named, read the attributes named (".metric").
RAW_CONFIG_PARAMETERS = {
    ("reward_trainer_from_buffer.py", "train", "composed"): (
        "Hydra's composed config: validated() turns it into the typed settings first thing",
        {"validated"},
    ),
    ("reward_trainer_from_buffer.py", "main", "cfg"): (
        "Hydra's entry point hands it to train(), which checks it; metric names the summary's figure a sweeper "
        "optimises",
        {"run_recipe", ".metric"},
    ),
    ("checks.py", "validate", "cfg"): ("the config being checked", {"validated"}),
    ("checks.py", "validated", "cfg"): ("the config being checked", {"checked_tree"}),
}
# The resolved DictConfig kept beside the typed settings (``run_record``) goes only where a DictConfig is the point.
RUN_RECORD_USES = {
    "start_run": "writes resolved_config.yaml and the logger's config, secrets masked (recipes.common.config)",
    "masked_fields": "the train: fields the record masks, so that trl's logs mask them too",
    "input_paths": "reads every recipe's optional path keys with OmegaConf.select",
    "ValidatedRun": "validated() hands it to train()",
}


def _functions(path: Path):
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, parents


def _annotation(arg: ast.arg) -> str:
    return ast.unparse(arg.annotation) if arg.annotation is not None else ""


def _uses(function, name: str, parents) -> set[str]:
    """How ``function``'s body reads ``name``: ``.attr`` for an attribute read, the callee for an argument."""
    uses = set()
    for node in ast.walk(function):
        if not (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)):
            continue
        parent = parents[node]
        if isinstance(parent, ast.keyword):
            parent = parents[parent]
        if isinstance(parent, ast.Attribute):
            uses.add(f".{parent.attr}")
        elif isinstance(parent, ast.Call) and node is not parent.func:
            uses.add(ast.unparse(parent.func).rsplit(".", 1)[-1])
        else:
            uses.add(f"<{type(parent).__name__} at line {node.lineno}>")
    return uses


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
    checked = validated(cfg)
    assert checked.settings == settings and isinstance(checked.run_record, DictConfig)
    assert checked.run_record.train.max_steps == 7


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.name)
def test_the_recipe_reads_no_raw_config_outside_the_listed_places(path):
    found = {}
    for function, parents in _functions(path):
        for arg in [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]:
            key = (path.name, function.name, arg.arg)
            annotation = _annotation(arg)
            if "DictConfig" in annotation or key in RAW_CONFIG_PARAMETERS:
                assert key in RAW_CONFIG_PARAMETERS, f"{key}: a DictConfig parameter; take the typed node instead"
                found[key] = _uses(function, arg.arg, parents)
            elif arg.arg == "cfg":
                assert annotation == "RewardRecipeConfig", f"{key}: cfg is the typed settings here, annotated so"
        record_uses = _uses(function, "run_record", parents)
        unexpected = record_uses - set(RUN_RECORD_USES)
        assert not unexpected, f"{path.name}:{function.name} uses run_record as {unexpected}: read the typed settings"
    for key, uses in found.items():
        _, allowed = RAW_CONFIG_PARAMETERS[key]
        assert uses <= allowed, f"{key}: reads {uses - allowed} of the composed config; read the typed settings"
    assert set(found) == {key for key in RAW_CONFIG_PARAMETERS if key[0] == path.name}, "a listed place is gone"
    # No module of the recipe reads a config through OmegaConf itself.
    assert "OmegaConf" not in {node.id for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Name)}
