"""The README and ``docs/*.md`` say what the code does: every recipe command they show composes and fits its recipe's
schema, every path, name and link they give exists, and the README's trl example runs.

A command is any ``python recipes/<recipe>.py ...`` (also under ``torchrun ...`` or ``accelerate launch ...``) in a
shell code block (lines continued with ``\\`` joined) or in inline code. It is composed through Hydra's compose API as
the recipe would compose it, with placeholders such as ``<run dir>`` filled with harmless values, every value of a
``-m`` sweep (and of a ``sweep=`` preset) composed, ``hydra.*`` overrides applied; then each composed config is
checked against the recipe's schema (``recipes.common.schema.checked_config``) and its ``train:`` node against trl's
config class. A renamed or misspelled key in the docs fails here. Nothing trains and nothing loads: a command naming
files that do not exist here (``data.path=train.jsonl``) only has to compose and fit the schema.
"""

from __future__ import annotations

import functools
import importlib
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
DOC_FILES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
RECIPES = ("grpo_torchrl_rm", "reward_trainer_from_buffer", "trl_grpo_torchrl_rollouts")

# Placeholders the docs write in commands, and what stands in for them: a model folder where a model is named, a
# path that exists nowhere else.
PLACEHOLDER_DIR = Path(tempfile.gettempdir()) / "docs-placeholder"
PLACEHOLDERS = {"hub id or folder": str(REPO_ROOT / "tiny" / "policy")}
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
LAUNCHERS = {"python", "python3", "torchrun"}
# Hydra's own command-line flags: those that take a value, and those that do not.
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "--config-name", "-cn", "--config-path", "-cp"}
HYDRA_FLAGS = {"--resolve", "--help", "-h", "--hydra-help"}
MULTIRUN_FLAGS = {"-m", "--multirun"}
QUIET_GROUPS = ("job_logging", "hydra_logging")


@dataclass(frozen=True)
class DocCommand:
    """One recipe command written in a doc: where, which recipe, and its arguments after the script."""

    source: str
    recipe: str
    args: tuple[str, ...]


# ------------------------------------------------------------------------------------------------ extraction


def extract_commands(text: str, source: str) -> list[DocCommand]:
    """Every recipe command in Markdown ``text``: shell code blocks first, then inline code outside them."""
    commands = []
    fence = re.compile(r"^(```|~~~)([\w-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
    for block in fence.finditer(text):
        if block.group(2).lower() not in SHELL_LANGUAGES:
            continue
        first_line = text.count("\n", 0, block.start(3)) + 1
        for offset, line in _logical_lines(block.group(3)):
            commands += _commands_in(line, f"{source}:{first_line + offset}")
    # Inline code: blocks blanked out (line numbers kept); a span may wrap onto the next line, never past a blank one.
    prose = fence.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in re.finditer(r"(?<!`)`((?:[^`\n]|\n(?![ \t]*\n))+)`(?!`)", prose):
        line = prose.count("\n", 0, span.start()) + 1
        commands += _commands_in(span.group(1).replace("\n", " "), f"{source}:{line}")
    return commands


def _logical_lines(block: str):
    """``(offset, line)`` for each line of a shell block, lines continued with a trailing backslash joined."""
    pending, start = "", 0
    for offset, line in enumerate(block.splitlines()):
        if not pending:
            start = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""
    if pending:
        yield start, pending


def _commands_in(line: str, source: str) -> list[DocCommand]:
    """The recipe commands of one shell line (several where ``&&``, ``;`` or ``|`` chain them)."""
    if "recipes/" not in line:
        return []
    # `python recipes/<recipe>.py --cfg job` is a command of every recipe.
    if "recipes/<recipe>.py" in line:
        return [c for recipe in RECIPES for c in _commands_in(line.replace("<recipe>", recipe), source)]
    line = re.sub(r"<([^<>\n]+)>", lambda m: _placeholder(m.group(1)), line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, segment = [], []
    for token in [*lexer, ";"]:
        if token and set(token) <= set(";&|"):
            command = _recipe_command(segment, source)
            commands += [command] if command else []
            segment = []
        else:
            segment.append(token)
    return commands


def _placeholder(name: str) -> str:
    return PLACEHOLDERS.get(name, str(PLACEHOLDER_DIR / re.sub(r"\W+", "_", name).strip("_")))


def _recipe_command(tokens: list[str], source: str) -> DocCommand | None:
    while tokens and re.fullmatch(r"\w+=.*", tokens[0]):  # FOO=1 python ...
        tokens = tokens[1:]
    launched = tokens[:1] and (tokens[0] in LAUNCHERS or tokens[:2] == ["accelerate", "launch"])
    for index, token in enumerate(tokens):
        match = re.fullmatch(r"(?:\./)?recipes/(\w+)\.py", token)
        if match and launched:
            return DocCommand(source, match.group(1), tuple(tokens[index + 1 :]))
    return None


# ------------------------------------------------------------------------------------------------ composition


def split_arguments(command: DocCommand) -> tuple[list[str], bool]:
    """The Hydra overrides of a command and whether it is a multirun; an unknown flag fails."""
    overrides, multirun, args = [], False, list(command.args)
    while args:
        arg = args.pop(0)
        if arg in MULTIRUN_FLAGS:
            multirun = True
        elif arg in HYDRA_FLAGS_WITH_VALUE:
            args.pop(0)
        elif arg in HYDRA_FLAGS:
            continue
        elif arg.startswith("-"):
            raise AssertionError(f"{command.source}: {arg!r} is not a flag of a Hydra recipe")
        else:
            overrides.append(arg)
    return overrides, multirun


def sweep_combinations(overrides: list[str], *, multirun: bool) -> list[list[str]]:
    """The override lists of the jobs to compose: the run itself without ``-m``; with it, as many jobs as the longest
    comma list has values, job ``i`` taking the ``i``-th value of each list (cycling), so that every value of every
    list is composed once without composing the whole product."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    if not multirun:
        sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
        assert not sweeps, f"{sweeps}: a sweep needs -m (Hydra refuses it in a single run)"
        return [list(overrides)]
    choices = [
        [f"{o.get_key_element()}={value}" for value in o.sweep_string_iterator()]
        if o.is_sweep_override()
        else [o.input_line]
        for o in parsed
    ]
    jobs = max((len(values) for values in choices), default=1)
    return [[values[i % len(values)] for values in choices] for i in range(jobs)]


def compose_job(recipe: str, overrides: list[str]):
    """The recipe's config for ``overrides``, composed as a run composes it (Hydra's node included)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    import recipes.common.config  # noqa: F401  (registers ${project_root:} and ${if_set:})

    # Hydra's logging configs play no part in the check and cost a quarter of each compose.
    quiet = [f"hydra/{g}=none" for g in QUIET_GROUPS if not any(o.startswith(f"hydra/{g}") for o in overrides)]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=recipe, overrides=[*overrides, *quiet], return_hydra_config=True)
    with open_dict(cfg):
        # Hydra sets the output dir when it starts a job; compose leaves it missing.
        cfg.hydra.runtime.output_dir = OmegaConf.select(cfg, "hydra.run.dir")
    return cfg


def check_job(recipe: str, cfg) -> None:
    """``cfg`` against the recipe's schema and, for the trl recipes, ``train:`` against trl's config class."""
    from hydra.core.hydra_config import HydraConfig

    from recipes.common.schema import check_trainer_config_keys, checked_config

    schema_module = importlib.import_module(
        {"grpo_torchrl_rm": "recipes.grpo.schema", "reward_trainer_from_buffer": "recipes.reward.schema"}.get(
            recipe, "recipes.trl_grpo.schema"
        )
    )
    schema = {
        "grpo_torchrl_rm": "GRPORecipeConfig",
        "reward_trainer_from_buffer": "RewardRecipeConfig",
        "trl_grpo_torchrl_rollouts": "TrlGRPORecipeConfig",
    }[recipe]
    HydraConfig.instance().set_config(cfg)  # checked_config reads the command line's keys from it, as in a run
    try:
        settled = checked_config(
            cfg, getattr(schema_module, schema), recipe=recipe, renamed=getattr(schema_module, "RENAMED", {})
        )
    finally:
        HydraConfig.instance().cfg = None
    if recipe == "reward_trainer_from_buffer":
        schema_module.checked_reward_trainer_config(settled.train)
    elif recipe == "trl_grpo_torchrl_rollouts":
        from trl import GRPOConfig

        check_trainer_config_keys(settled.train, GRPOConfig)


def check_command(command: DocCommand) -> int:
    """Composes and checks every job of ``command``; returns how many there were."""
    assert command.recipe in RECIPES, f"{command.source}: no recipe recipes/{command.recipe}.py"
    overrides, multirun = split_arguments(command)
    jobs = sweep_combinations(overrides, multirun=multirun)
    for job in jobs:
        _check_overrides(command.recipe, tuple(job))
    return len(jobs)


@functools.cache
def _check_overrides(recipe: str, overrides: tuple[str, ...]) -> None:
    """One job, composed and checked once per session (the docs repeat the plain runs)."""
    cfg = compose_job(recipe, list(overrides))
    # A sweep preset (sweep=...) holds its grid in hydra.sweeper.params: each of its values too.
    params = cfg.hydra.sweeper.get("params") or {}
    preset = [f"{key}={value}" for key, value in params.items()]
    if preset:
        for job in sweep_combinations(preset, multirun=True):
            check_job(recipe, compose_job(recipe, [*overrides, *job]))
    else:
        check_job(recipe, cfg)


# ------------------------------------------------------------------------------------------------ the docs' commands

COMMANDS = [
    command
    for path in DOC_FILES
    for command in extract_commands(path.read_text(encoding="utf-8"), path.relative_to(REPO_ROOT).as_posix())
]


def test_the_docs_show_commands_of_every_recipe():
    assert {command.recipe for command in COMMANDS} == set(RECIPES)
    assert len(COMMANDS) >= 60, len(COMMANDS)
    # The Quickstart's run, which CI's install line ends with, is among them.
    assert any(c.source.startswith("README.md") and c.recipe == "grpo_torchrl_rm" and not c.args for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.source}:{c.recipe}" for c in COMMANDS])
def test_each_command_in_the_docs_composes_and_fits_its_recipe_schema(command):
    assert check_command(command) >= 1


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.source}:{c.recipe}" for c in COMMANDS])
def test_each_command_in_the_docs_parses_as_written(command):
    """Hydra's own argument parser reads the command as typed: overrides after a flag (``a=1 -m seed=0,1``) are
    "unrecognized arguments" there (exit 2), though composing its overrides alone would pass."""
    from hydra._internal.utils import get_args_parser

    args = [str(arg) for arg in command.args]
    try:
        get_args_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{command.source}: {' '.join(args)} is refused by Hydra's command line (exit 2)")


def test_the_replay_sweep_is_a_whole_command_hydra_reads():
    """docs/trl_grpo_rollouts.md gave the replay sweep as a fragment to append ("... rollout.replay.enabled=true,false
    -m seed=0,1,2"), which appended as written exits 2: it is a whole command now, composed and parsed above."""
    sweeps = [c for c in COMMANDS if "rollout.replay.enabled=true,false" in c.args and c.source.startswith("docs/trl")]
    assert sweeps and all(check_command(command) == 3 for command in sweeps)  # every value of each list composed


def test_the_key_by_key_calculator_command_is_the_calculator_preset():
    """docs/trl_grpo_rollouts.md calls it "the same, key by key": it ran with the default max_completion_length of
    32, where no tool result fits, and trained nothing. Composed, it is experiment=calculator setting for setting
    (a function's weight left to its default of 1.0)."""
    from omegaconf import OmegaConf

    (command,) = [c for c in COMMANDS if c.source.startswith("docs/trl") and "model=tiny_calculator" in c.args]
    by_key = OmegaConf.to_container(compose_job(command.recipe, list(command.args)), resolve=False)
    preset = OmegaConf.to_container(compose_job(command.recipe, ["experiment=calculator"]), resolve=False)
    for config in (by_key, preset):
        config.pop("hydra")
        config["reward"]["functions"]["exact_answer"].setdefault("weight", 1.0)
    assert by_key == preset


# ------------------------------------------------------------------------------------------------ the checker itself

SAMPLE = """\
Some prose with `python recipes/grpo_torchrl_rm.py seed=3` inline, and a mere path: `recipes/grpo_torchrl_rm.py`.

```bash
# a comment line
python recipes/grpo_torchrl_rm.py model.name_or_path=<hub id or folder> \\
    device=cpu     # a trailing comment
torchrun --standalone --nproc_per_node 2 recipes/grpo_torchrl_rm.py hydra.run.dir=<run dir>
accelerate launch --multi_gpu --num_processes 2 recipes/reward_trainer_from_buffer.py \\
    train.per_device_train_batch_size=16
. .venv/bin/activate && python recipes/trl_grpo_torchrl_rollouts.py -m seed=0,1
python scripts/plot_run.py <run dir>
```

```python
print("python recipes/grpo_torchrl_rm.py in a Python block is not a command")
```
"""


def test_the_extractor_reads_blocks_continued_lines_inline_code_and_launchers():
    commands = extract_commands(SAMPLE, "sample.md")
    assert [(c.source, c.recipe, c.args) for c in commands] == [
        ("sample.md:5", "grpo_torchrl_rm", (f"model.name_or_path={REPO_ROOT / 'tiny' / 'policy'}", "device=cpu")),
        ("sample.md:7", "grpo_torchrl_rm", (f"hydra.run.dir={PLACEHOLDER_DIR / 'run_dir'}",)),
        ("sample.md:8", "reward_trainer_from_buffer", ("train.per_device_train_batch_size=16",)),
        ("sample.md:10", "trl_grpo_torchrl_rollouts", ("-m", "seed=0,1")),
        ("sample.md:1", "grpo_torchrl_rm", ("seed=3",)),
    ]
    assert sum(check_command(c) for c in commands) == 6  # the sweep is two jobs


def _only_command(markdown: str) -> DocCommand:
    (command,) = extract_commands(markdown, "bad.md")
    return command


def test_a_misspelled_or_renamed_key_in_a_doc_command_fails():
    from hydra.errors import ConfigCompositionException

    from recipes.common.config import ConfigError

    # Added with +: Hydra accepts it, the schema refuses it, naming the key and the nearest one.
    with pytest.raises(ConfigError, match=r"optimizer\.lrr.*Did you mean optimizer\.lr"):
        check_command(_only_command("```bash\npython recipes/grpo_torchrl_rm.py +optimizer.lrr=1e-3\n```"))
    # Without +: Hydra itself refuses to compose it.
    with pytest.raises(ConfigCompositionException, match="lrr"):
        check_command(_only_command("`python recipes/grpo_torchrl_rm.py optimizer.lrr=1e-3`"))
    # A key of an earlier version names its replacement.
    with pytest.raises(ConfigError, match=r"rollout\.store\.max_rows"):
        check_command(_only_command("`python recipes/trl_grpo_torchrl_rollouts.py +rollouts.max_rows=10`"))
    # trl's own config: a field trl does not have.
    with pytest.raises(ConfigError, match=r"train\.max_step\b"):
        check_command(_only_command("`python recipes/trl_grpo_torchrl_rollouts.py +train.max_step=3`"))
    # Every job of a sweep is checked, not only the first.
    with pytest.raises(ConfigError, match="scale_rewards"):
        check_command(_only_command("`python recipes/grpo_torchrl_rm.py -m advantage.scale_rewards=group,grup`"))
    # A comma list without -m is no single run.
    with pytest.raises(AssertionError, match="needs -m"):
        check_command(_only_command("`python recipes/grpo_torchrl_rm.py seed=0,1`"))


# ------------------------------------------------------------------------------------------------ named paths


# Paths (`recipes/grpo/checks.py`, `tiny/policy`) and dotted names (`interop.TorchRLRolloutFunc`,
# `recipes.tasks.arithmetic.exact_answer_reward`) of the repository.
REPOSITORY_PATH = re.compile(r"(?<![\w/.<-])((?:interop|recipes|scripts|tests|conf|docs|tiny)/[\w./-]*\w)")
DOTTED_NAME = re.compile(r"(?<![\w./])((?:interop|recipes)(?:\.\w+)+)")


def test_every_repository_path_and_dotted_name_in_the_docs_exists():
    """Modules move: a doc naming ``recipes/grpo/sampling.py`` or ``interop.SamplingPolicy`` after the move fails."""
    missing = []
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        for name in set(REPOSITORY_PATH.findall(text)):
            if "<" not in name and not (REPO_ROOT / name).exists():
                missing.append(f"{path.name}: {name}")
        for dotted in set(DOTTED_NAME.findall(text)):
            if not _importable(dotted):
                missing.append(f"{path.name}: {dotted}")
    assert not missing, "named in the docs but not in the repository:\n" + "\n".join(sorted(missing))


def test_every_link_between_the_pages_lands():
    """A relative Markdown link names a file that exists and, after ``#``, one of its headings (GitHub's anchor)."""
    broken = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^()\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"\w+://", target):
                continue
            file, _, fragment = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.name}: {target}")
            elif fragment and fragment not in _anchors(linked):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, "links that land nowhere:\n" + "\n".join(broken)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", path.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def _importable(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if attribute in getattr(obj, "__all__", ()) and attribute not in vars(obj):
                return True  # a name a package exports lazily (interop.TorchRLGRPOTrainer imports trl's trainer)
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


# ------------------------------------------------------------------------------------------------ the trl example


def readme_block(marker: str) -> str:
    """The fenced block right after ``<!-- test: <marker> -->`` in the README."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(rf"<!-- test: {re.escape(marker)} -->\n```\w*\n(.*?)^```", text, re.M | re.S)
    assert found, f"README.md has no block marked <!-- test: {marker} -->"
    return found.group(1)


def test_the_readme_trl_example_runs_as_a_user_runs_it(tmp_path, capfd):
    """The block a trl user copies, run as they run it: ``python trl_example.py`` in a folder of its own, ``tiny``
    beside it, the package on the path, offline (its ``__main__`` in this process: tests/_in_process.run_script; a
    process of its own spent most of its 12 s importing trl, transformers and torchrl again)."""
    from _in_process import run_script

    (tmp_path / "tiny").symlink_to(REPO_ROOT / "tiny")
    script = tmp_path / "trl_example.py"
    script.write_text(readme_block("trl-example"))
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    returncode = run_script(script, env=env, cwd=tmp_path)
    stdout, stderr = capfd.readouterr()
    assert returncode == 0, f"{stdout[-3000:]}\n{stderr[-5000:]}"
    # Four scored completions, each with trl's advantage and its text.
    printed = re.findall(r"^[+-]\d+\.\d\d  (\S.*)$", stdout, re.M)
    assert len(printed) == 4 and all(len(text.split()) >= 2 for text in printed), stdout[-2000:]


@pytest.mark.slow
def test_the_async_library_example_runs_as_written(tmp_path, capfd):
    """docs/trl_grpo_rollouts.md's async example for library users (a datasets.Dataset, trl's default shuffling), run
    as a user runs it: a script in a folder of its own, ``tiny`` beside it, offline (``python async_example.py`` in
    this process, whose sampling process imports the script again as a spawned child does)."""
    from _in_process import run_script

    text = (REPO_ROOT / "docs" / "trl_grpo_rollouts.md").read_text(encoding="utf-8")
    after = text[text.index("As a library, `TorchRLGRPOTrainer` takes the async") :]
    block = re.search(r"```python\n(.*?)```", after, re.S).group(1)
    (tmp_path / "tiny").symlink_to(REPO_ROOT / "tiny")
    (tmp_path / "async_example.py").write_text(block)
    env = {"HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": str(REPO_ROOT)}
    returncode = run_script(tmp_path / "async_example.py", env=env, cwd=tmp_path)
    stdout, stderr = capfd.readouterr()
    assert returncode == 0, stderr[-3000:]
    assert stdout.strip().splitlines()[-1] == "[0.0, 1.0]", stdout[-1000:]
