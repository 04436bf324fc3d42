"""recipes/common/run_folder.py: overwrite=true deletes only the records a recipe writes, never through a link and never
what the run reads; one run per folder at a time; a folder the run cannot write fails at start-up."""

from __future__ import annotations

import os

import pytest
from _small_runs import GRPO_SMALL, REWARD_SMALL

from recipes.common.config import ConfigError
from recipes.common.run_folder import RunFolderLock, check_writable, clear_records


def test_overwrite_deletes_a_linked_record_as_a_link(tmp_path):
    kept = tmp_path / "elsewhere" / "my_model"
    kept.mkdir(parents=True)
    (kept / "weights.safetensors").write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "model").symlink_to(kept, target_is_directory=True)
    (run / "metrics.csv").write_text("step\n1\n")
    assert clear_records(run) == ["metrics.csv", "model"]
    assert not (run / "model").exists() and (kept / "weights.safetensors").read_text() == "precious"


@pytest.mark.parametrize("root", ["grpo_torchrl_rm", "reward_trainer_from_buffer"])
def test_overwrite_never_deletes_what_the_run_reads(compose_config, tmp_path, tiny_dir, root):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_dir / "reward_model", run / "model")
    (run / "summary.json").write_text("{}")
    small = GRPO_SMALL if root == "grpo_torchrl_rm" else REWARD_SMALL
    cfg = compose_config(
        root, [*small, f"output_dir={run}", "overwrite=true", f"reward_model.name_or_path={run}/model"]
    )
    module = __import__(f"recipes.{root}", fromlist=["train"])
    with pytest.raises(ConfigError, match=rf"overwrite=true would delete {run}/model, which reward_model.name_or_path"):
        module.train(cfg)
    assert (run / "model" / "model.safetensors").is_file() and (run / "summary.json").is_file()


def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_first(compose_config, tmp_path):
    import recipes.grpo_torchrl_rm as recipe

    lock = RunFolderLock(tmp_path)
    try:
        with pytest.raises(ConfigError, match=rf"{tmp_path} is in use by another run \(process {os.getpid()}\)"):
            recipe.train(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", "train.steps=1"]))
    finally:
        lock.release()
    summary = recipe.train(compose_config("grpo_torchrl_rm", [*GRPO_SMALL, f"output_dir={tmp_path}", "train.steps=1"]))
    assert summary["train/steps"] == 1
    RunFolderLock(tmp_path).release()  # the run let go of it


def test_a_folder_the_run_cannot_write_fails_at_start_up(tmp_path):
    (tmp_path / "checkpoints").write_text("a file where the run keeps its checkpoints")
    with pytest.raises(ConfigError, match=r"Cannot write the run's checkpoints folder .*checkpoints"):
        check_writable(tmp_path / "checkpoints", what="the run's checkpoints folder", fix="fix it")


def test_overwrite_clears_the_earlier_runs_resumes_and_failure_too(tmp_path):
    for name in ("metrics.csv", "resumes.jsonl", "failed.json"):
        (tmp_path / name).write_text("from the earlier run\n")
    assert sorted(clear_records(tmp_path)) == ["failed.json", "metrics.csv", "resumes.jsonl"]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("recipe", ["grpo_torchrl_rm", "trl_grpo_torchrl_rollouts"])
def test_a_run_refused_on_a_folder_in_use_changes_nothing_of_the_run_there(tmp_path, capfd, recipe):
    """Run B with overwrite=true on the folder where run A is training is refused "in use" and leaves every file of
    A's as it was: Hydra's ``.hydra/`` records (which Hydra wrote before any recipe code ran), its log, its metrics.
    (Run B's command line in this process: the lock is an ``flock`` on a file of its own opening, which the test's
    lock holds against it as another process's would.)"""
    from _in_process import run_script

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run / ".hydra" / name).write_text(f"run A's {name}\n")
    (run / f"{recipe}.log").write_text("run A's log\n")
    (run / "metrics.csv").write_text("step\n1\n")
    lock = RunFolderLock(run)  # run A, training
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    try:
        returncode = run_script(
            f"recipes/{recipe}.py", f"hydra.run.dir={run}", "overwrite=true", "seed=7", env={"HF_HUB_OFFLINE": "1"}
        )
    finally:
        lock.release()
    output = capfd.readouterr()
    assert returncode == 1 and f"{run} is in use by another run" in output.err + output.out
    after = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    assert after == before


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_a_run_folder_that_cannot_be_written_is_refused_naming_it_not_with_hydras_traceback(tmp_path, capfd, mode):
    """A folder below a file stands for any folder this user cannot write (a read-only one: the tests run as root).
    The run as a process of its own, as typed; the sweep's command line in this process (tests/_in_process)."""
    import subprocess
    import sys
    from pathlib import Path

    from _in_process import run_script

    (tmp_path / "a_file").write_text("")
    folder = tmp_path / "a_file" / "run"
    key = "hydra.run.dir" if mode == "run" else "hydra.sweep.dir"
    arguments = ["recipes/grpo_torchrl_rm.py", f"{key}={folder}", *(["-m"] if mode == "sweep" else [])]
    if mode == "run":
        completed = subprocess.run(
            [sys.executable, *arguments], cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True
        )
        returncode, stderr = completed.returncode, completed.stderr
    else:
        returncode, stderr = run_script(*arguments), capfd.readouterr().err
    assert returncode == 1 and "Traceback" not in stderr
    assert f"Cannot write the run's output folder {folder} (Not a directory): choose a folder" in stderr or (
        f"Cannot write the sweep's folder {folder} (Not a directory)" in stderr
    )
    assert f"({key}=...)" in stderr
