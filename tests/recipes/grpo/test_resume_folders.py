"""A resumed GRPO run writes where it was told to and reports as the run it continues: a copied and moved run folder
resumes as itself where it is (the original untouched), and main() returns the metric the run's own config names (an
experiment=arithmetic run resumed without repeating experiment=arithmetic)."""

from __future__ import annotations

import shutil

import pytest
from _in_process import run_script
from _small_runs import GRPO_SMALL


def _files(folder):
    return {str(path.relative_to(folder)): path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()}


def _run(*overrides):
    """``python recipes/grpo_torchrl_rm.py <overrides>``, its exit status (in this process: run_script)."""
    return run_script("recipes/grpo_torchrl_rm.py", *overrides)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step run folder, checkpointed at each step, made once for this module's tests: each copies or moves it
    only after recording its files, so the tests that share it never change it."""
    folder = tmp_path_factory.mktemp("finished") / "D"
    assert _run(*GRPO_SMALL, "train.steps=2", "checkpoint.every_n_steps=1", f"hydra.run.dir={folder}") == 0
    return folder


def test_a_copied_then_moved_run_folder_resumes_where_it_is_and_leaves_the_original_alone(
    finished_run, tmp_path, capfd
):
    """As a user does it: ``cp -r D D2``, ``mv D2 D3``, then ``resume=true hydra.run.dir=D3``. The run resumes as
    itself where its folder is now (neither in D, where it ran, nor in D2, where it was copied), and D is untouched.
    (Formerly two tests, a copied folder and a moved one, each resuming a copy of the shared run: one resume now.)"""
    original, copy, moved = finished_run, tmp_path / "D2", tmp_path / "D3"
    before = _files(original)
    shutil.copytree(original, copy)
    copy.rename(moved)

    resumed = _run(f"hydra.run.dir={moved}", "resume=true", "train.steps=4")

    assert resumed == 0, capfd.readouterr().err[-2000:]
    assert _files(original) == before, "the folder the copy came from is untouched"
    assert not copy.exists()
    assert sorted(path.name for path in (moved / "checkpoints").iterdir()) == ["step_0000003", "step_0000004"]
    assert f"output_dir: {moved}\n" in (moved / "resolved_config.yaml").read_text()


def test_a_resumed_experiment_reports_the_metric_its_own_config_names(compose_config, capfd, tmp_path):
    """The arithmetic experiment's metric is eval/accuracy_last; a resume that does not repeat experiment=arithmetic
    must not look for the YAML default's rollout/oracle_mean_last. The first run in this process (what the resume
    reads of it is its resolved_config.yaml and checkpoint), the resume as a user types it, through main() (its
    command line in this process too: tests/_in_process.run_script)."""
    import recipes.grpo_torchrl_rm as recipe

    common = [*GRPO_SMALL[1:], "eval.every_n_steps=2", "eval.num_prompts=4", f"output_dir={tmp_path}"]
    recipe.train(compose_config("grpo_torchrl_rm", ["experiment=arithmetic", "train.steps=2", *common]))
    returncode = _run("resume=true", "train.steps=3", f"hydra.run.dir={tmp_path}")
    stderr = capfd.readouterr().err
    assert returncode == 0, stderr[-2000:]
    assert "KeyError" not in stderr


def test_a_run_folder_saved_before_a_setting_existed_resumes_once_the_command_line_gives_it(
    compose_config, finished_run, tmp_path
):
    """A folder written by an earlier version lacks the settings added since (optimizer.fused): a resume with the
    version's default in their place could train another run, so it is refused naming the setting and how to give
    it; given on the command line as the message says (a change the resume allows, recorded in resumes.jsonl), the
    resume goes on with it."""
    import recipes.grpo_torchrl_rm as recipe
    from recipes.common.config import ConfigError

    folder = tmp_path / "D"
    shutil.copytree(finished_run, folder)
    record = folder / "resolved_config.yaml"
    record.write_text(record.read_text().replace("  fused: true\n", ""))
    run = [*GRPO_SMALL, "train.steps=2", "checkpoint.every_n_steps=1", f"output_dir={folder}", "resume=true"]
    with pytest.raises(
        ConfigError, match=r"optimizer\.fused is missing: .* saved before this setting existed"
    ) as error:
        recipe.validate(compose_config("grpo_torchrl_rm", run))
    fix = str(error.value).split("resume it with ")[1].split(" (its default")[0]
    assert fix == "optimizer.fused=<value> resume_allow_changes=[optimizer.fused]"
    given = [*run, "optimizer.fused=false", "resume_allow_changes=[optimizer.fused]"]
    resumed = recipe.validate(compose_config("grpo_torchrl_rm", given))
    assert resumed.optimizer.fused is False
