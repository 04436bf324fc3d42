"""Every root config composes with every option of every group, and every ``_target_`` matches its signature.

Nothing is built or downloaded here: like torchtune's config tests, targets are imported and their signatures checked
against the keys the YAML passes.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from pathlib import Path

import pytest
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, ListConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
ROOT_CONFIGS = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
# Groups whose options are whole-run presets (`# @package _global_`) or Hydra plugins are composed the same way.
GROUP_OPTIONS = sorted(
    (group.relative_to(CONF_DIR).as_posix(), option.stem)
    for group in CONF_DIR.rglob("*")
    if group.is_dir()
    for option in group.glob("*.yaml")
)


@functools.cache  # read once per root: the collection asks for every option of every group (99 YAML loads, 1.5 s)
def _groups_in_defaults(root: str) -> frozenset[str]:
    """The groups a root config selects (``- model: tiny``, ``- optional sweep: null``...), Hydra's own included."""
    defaults = OmegaConf.load(CONF_DIR / f"{root}.yaml").get("defaults", [])
    names = {
        str(next(iter(entry))).removeprefix("optional ").lstrip("/").split("@")[0]
        for entry in defaults
        if hasattr(entry, "keys")
    }
    return frozenset(names | {"hydra/launcher"})


def _presets_of(root: str, group: str, option: str) -> bool:
    """Whether an option is ``root``'s: every option, except that ``conf/experiment/`` is shared by the recipes' config
    trees and a preset there is the recipe's that has a part for it (``conf/experiment_for/<root>/<option>.yaml``),
    and that a recipe's parts are composed through ``experiment=`` only."""
    if group.startswith("experiment_for/"):
        return False
    if group != "experiment":
        return True
    return (CONF_DIR / "experiment_for" / root / f"{option}.yaml").is_file()


# Each root with each option of each group it selects (a group of the other recipe is not this root's choice).
COMBINATIONS = [
    (root, group, option)
    for root in ROOT_CONFIGS
    for group, option in GROUP_OPTIONS
    if group in _groups_in_defaults(root) and _presets_of(root, group, option)
]
# Options that only make sense with a value the user must give (a path): composed with a placeholder.
REQUIRED_OVERRIDES = {("data", "file"): ["data.path=/nonexistent.jsonl"], ("data", "hf"): ["data.name_or_path=x"]}


def _groups_inside_options() -> set[str]:
    """Groups that options of other groups select (``/lora@lora: default`` in every model node), not a root."""
    names = set()
    for group, option in GROUP_OPTIONS:
        for entry in OmegaConf.load(CONF_DIR / group / f"{option}.yaml").get("defaults", []) or []:
            if hasattr(entry, "keys"):
                names.add(str(next(iter(entry))).split("@")[0].lstrip("/"))
    return names


def test_repository_has_both_root_configs():
    assert {"grpo_torchrl_rm", "reward_trainer_from_buffer"} <= set(ROOT_CONFIGS)
    # Every option of every group is composed with at least one root, or inside an option that is.
    nested = {(group, option) for group, option in GROUP_OPTIONS if group in _groups_inside_options()}
    # A recipe's part of a preset is composed through experiment=<its name>.
    parts = {(group, option) for group, option in GROUP_OPTIONS if group.startswith("experiment_for/")}
    composed = {(group, option) for _, group, option in COMBINATIONS}
    assert composed | nested | parts == set(GROUP_OPTIONS)
    assert nested == {("lora", "default")}
    presets = {(f"experiment_for/{root}", option) for root, group, option in COMBINATIONS if group == "experiment"}
    assert presets == parts  # every part belongs to a preset of conf/experiment/ that its recipe composes


def _group_override(group: str, option: str) -> str:
    # `hydra/launcher=joblib` style groups are selected the same way as `model=tiny`.
    return f"{group}={option}"


def _iter_targets(node, path="cfg"):
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path, node
        for key in node.keys():
            if key == "hydra":
                continue
            yield from _iter_targets(node._get_node(key), f"{path}.{key}")
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            yield from _iter_targets(item, f"{path}[{i}]")


def _check_targets(cfg: DictConfig) -> None:
    for path, node in _iter_targets(cfg):
        module_name, _, attr = OmegaConf.select(node, "_target_").rpartition(".")
        target = getattr(importlib.import_module(module_name), attr)
        signature = inspect.signature(target)
        accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        passed = [k for k in node.keys() if not str(k).startswith("_")]
        unknown = [k for k in passed if k not in signature.parameters]
        assert accepts_kwargs or not unknown, f"{path}: {target} takes no {unknown}"


@pytest.mark.parametrize(("root", "group", "option"), COMBINATIONS)
def test_every_option_composes(compose_config, root, group, option):
    overrides = [_group_override(group, option), *REQUIRED_OVERRIDES.get((group, option), [])]
    cfg = compose_config(root, overrides)
    resolvable = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    # Every interpolation resolves (no typo in a ${...}); `???` values are the only ones left for the user.
    OmegaConf.to_container(resolvable, resolve=True, throw_on_missing=False)
    _check_targets(cfg)


@pytest.mark.parametrize("root", ROOT_CONFIGS)
def test_root_config_opens_with_a_comment_and_the_command(root):
    text = (CONF_DIR / f"{root}.yaml").read_text()
    assert text.startswith("#"), f"conf/{root}.yaml should open with a comment saying what it is"
    assert f"recipes/{root}.py" in text.split("\n\n")[0], f"conf/{root}.yaml's opening comment should give the command"


@pytest.mark.parametrize("root", ROOT_CONFIGS)
def test_unknown_group_option_names_the_choices(compose_config, root):
    with pytest.raises(MissingConfigException) as error:
        compose_config(root, ["model=no_such_model"])
    message = str(error.value)
    assert "no_such_model" in message and "tiny" in message  # Hydra lists the available options


@pytest.mark.parametrize("root", ROOT_CONFIGS)
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local", "slurm_gpu"])
def test_launcher_plugins_compose(compose_config, root, launcher):
    cfg = compose_config(root, [f"hydra/launcher={launcher}"])
    assert "launcher" in cfg.hydra.launcher._target_.lower()


@pytest.mark.parametrize("root", ROOT_CONFIGS)
def test_help_lists_the_groups_of_its_recipe_with_every_option(capfd, root):
    """``--help`` names the groups the recipe selects (not the other recipe's), each with exactly the options in
    ``conf/`` (a preset group with this recipe's presets alone). The first recipe's ``--help`` in a process of its
    own, as typed; the others' ``__main__`` in this process (the same code, without 4 s of imports per process)."""
    import subprocess
    import sys

    from _in_process import run_script

    if root == ROOT_CONFIGS[0]:
        result = subprocess.run(
            [sys.executable, f"recipes/{root}.py", "--help"], cwd=CONF_DIR.parent, capture_output=True, text=True
        )
        returncode, stdout, stderr = result.returncode, result.stdout, result.stderr
    else:
        returncode = run_script(f"recipes/{root}.py", "--help")
        stdout, stderr = capfd.readouterr()
    assert returncode == 0, stderr[-2000:]
    groups_part = stdout.split("== Configuration groups (group=option) ==")[1].split("==")[0]
    listed = {
        line.split(":")[0]: [option.strip() for option in line.split(":", 1)[1].split("(")[0].split(",")]
        for line in groups_part.strip().splitlines()
    }
    assert set(listed) == {group for group in _groups_in_defaults(root) if not group.startswith("experiment_for/")}
    for group, options in listed.items():
        on_disk = sorted(option for g, option in GROUP_OPTIONS if g == group)
        if group == "hydra/launcher":
            on_disk = sorted(["basic", "joblib", *on_disk])  # Hydra's own launchers and the plugin's
        elif group == "sweep":
            on_disk = [option for option in on_disk if option.startswith(root.split("_")[0])]
        elif group == "experiment":
            on_disk = [option for option in on_disk if _presets_of(root, group, option)]
        assert sorted(options) == on_disk, group
    assert stdout.startswith(f"{root}: ")  # what the recipe does comes first


PRESETS = sorted(path.stem for path in (CONF_DIR / "experiment").glob("*.yaml"))
GRPO_RECIPES = ["grpo_torchrl_rm", "trl_grpo_torchrl_rollouts"]


@pytest.mark.parametrize("root", GRPO_RECIPES)
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_under_its_one_name_in_each_grpo_recipe_or_is_refused_naming_the_one_it_fits(
    compose_config, capsys, tmp_path, root, preset
):
    """One vocabulary: ``experiment=<name>`` is the same task in both GRPO recipes (the shared part and the recipe's
    own), its settings pass the recipe's checks; a preset with no part for a recipe is refused there before Hydra
    composes, naming the recipe it fits (``experiment=trl_defaults`` is the GRPO recipe's alone)."""
    from recipes.common.schema import refuse_unknown_overrides
    from recipes.grpo.schema import GRPORecipeConfig
    from recipes.trl_grpo.schema import TrlGRPORecipeConfig

    schema = {"grpo_torchrl_rm": GRPORecipeConfig, "trl_grpo_torchrl_rollouts": TrlGRPORecipeConfig}[root]
    if not (CONF_DIR / "experiment_for" / root / f"{preset}.yaml").is_file():
        with pytest.raises(SystemExit) as refused:
            refuse_unknown_overrides([f"experiment={preset}"], schema, recipe=root)
        message = capsys.readouterr().err
        fits = [other for other in GRPO_RECIPES if (CONF_DIR / "experiment_for" / other / f"{preset}.yaml").is_file()]
        assert refused.value.code == 1 and fits
        assert f"experiment={preset} fits " in message and all(f"recipes/{other}.py" in message for other in fits)
        return
    refuse_unknown_overrides([f"experiment={preset}"], schema, recipe=root)  # no refusal
    cfg = compose_config(root, [f"experiment={preset}", f"output_dir={tmp_path}"])
    shared = OmegaConf.load(CONF_DIR / "experiment" / f"{preset}.yaml")
    for entry in shared.get("defaults", []):  # the task's model, data and reward model, whichever recipe runs it
        (group, option), *_ = entry.items()
        assert cfg.hydra.runtime.choices[group.removeprefix("override /")] == option
    shared_settings = OmegaConf.masked_copy(shared, [key for key in shared.keys() if key != "defaults"])
    assert OmegaConf.merge(cfg, shared_settings) == cfg  # every shared setting holds in the composed config
    # The composed config passes the recipe's own checks, everything before a model loads.
    import recipes.grpo.checks
    import recipes.trl_grpo.checks

    validate = {"grpo_torchrl_rm": recipes.grpo.checks, "trl_grpo_torchrl_rollouts": recipes.trl_grpo.checks}[root]
    validate.validate(cfg)


def test_a_renamed_preset_is_refused_naming_its_new_name(capsys):
    from recipes.common.schema import refuse_unknown_overrides
    from recipes.trl_grpo.schema import TrlGRPORecipeConfig

    with pytest.raises(SystemExit):
        refuse_unknown_overrides(["experiment=calculator_trl"], TrlGRPORecipeConfig, recipe="trl_grpo_torchrl_rollouts")
    assert "experiment=calculator now" in capsys.readouterr().err


def test_the_suites_yaml_loads_parse_each_text_once_and_hand_out_configs_of_their_own(tmp_path):
    """tests/_parsed_yaml.py (installed for every test process): a text seen before is not parsed again, each load
    still gets a config of its own, a file rewritten at once with text of the same length is read anew, and a
    malformed file's error names it as PyYAML names it."""
    import yaml
    from omegaconf import OmegaConf

    assert getattr(OmegaConf.load, "_parses_each_text_once", False), "conftest did not install the cache"
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1e-3\n  steps: 4\nname: ???\n")
    first = OmegaConf.load(path)
    first.train.steps = 99
    parsed = []
    original_load = yaml.load
    try:
        yaml.load = lambda *args, **kwargs: parsed.append(1) or original_load(*args, **kwargs)
        second = OmegaConf.load(str(path))
        with open(path) as handle:
            third = OmegaConf.load(handle)
    finally:
        yaml.load = original_load
    assert parsed == [] and second.train.steps == 4 and third.train.steps == 4 and second is not third
    assert second.train.lr == 1e-3 and OmegaConf.is_missing(second, "name")
    path.write_text("train:\n  lr: 2e-3\n  steps: 4\nname: ???\n")  # same length, within the same instant
    assert OmegaConf.load(path).train.lr == 2e-3
    path.write_text("train: [1\n")
    with pytest.raises(yaml.YAMLError, match=rf'in "{path}", line 1'):
        OmegaConf.load(path)
