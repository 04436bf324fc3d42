"""Hydra multirun of each recipe as a user types it: one folder, one summary and one finished wandb run per job."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _in_process import run_script
from _small_runs import GRPO_SMALL, REWARD_SMALL

RECIPES = {
    "grpo_torchrl_rm": [*GRPO_SMALL, "train.steps=2"],
    "reward_trainer_from_buffer": [*REWARD_SMALL, "train.max_steps=4"],
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_two_job_multirun_writes_one_summary_per_job(recipe, tmp_path, repo_root):
    """The sweep's command line in this process (Hydra's basic launcher runs the jobs in it, as in a user's process)."""
    sweep_dir = tmp_path / "sweep"
    arguments = [
        "-m",
        "seed=0,1",
        *RECIPES[recipe],
        "logger=wandb",
        "logger.wandb.mode=offline",
        "logger.wandb.group=test-sweep",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    env = {"HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true"}
    assert run_script(repo_root / "recipes" / f"{recipe}.py", *arguments, env=env, cwd=tmp_path) == 0

    summaries = {job: json.loads((sweep_dir / job / "summary.json").read_text()) for job in ("0", "1")}
    for job, summary in summaries.items():
        overrides = (sweep_dir / job / ".hydra" / "overrides.yaml").read_text()
        assert f"seed={job}" in overrides
        metric = (sweep_dir / job / "resolved_config.yaml").read_text().split("\nmetric: ", 1)[1].split("\n", 1)[0]
        assert isinstance(summary[metric], float)
    # Each job is its own wandb run, finished before the next job starts in the same process.
    runs = sorted(sweep_dir.rglob("offline-run-*"))
    assert len(runs) == 2, runs
    assert {run.relative_to(sweep_dir).parts[0] for run in runs} == {"0", "1"}

    report = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "sweep_report.py"), str(sweep_dir)],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "seed=0" in report.stdout and "seed=1" in report.stdout


def test_a_failed_job_does_not_stop_the_sweep_and_the_sweep_says_so(tmp_path, repo_root, capfd):
    """Job 0 is refused (an Adam learning rate of 5), job 1 trains: the sweep runs both, records the failure in job
    0's folder and exits non-zero naming it; the report lists it. (The sweep's command line in this process, with
    Hydra's basic launcher; the sweep whose jobs run in other processes below is started as a process.)"""
    sweep_dir = tmp_path / "sweep"
    returncode = run_script(
        repo_root / "recipes" / "grpo_torchrl_rm.py",
        "-m",
        "optimizer.lr=5,2e-3",
        *GRPO_SMALL,
        "train.steps=1",
        f"hydra.sweep.dir={sweep_dir}",
        env={"HF_HUB_OFFLINE": "1"},
        cwd=tmp_path,
    )
    stderr = capfd.readouterr().err
    assert returncode == 1
    assert "1 job(s) of the sweep failed" in stderr and str(sweep_dir / "0") in stderr
    assert "optimizer.lr=5" in json.loads((sweep_dir / "0" / "failed.json").read_text())["reason"]
    assert json.loads((sweep_dir / "1" / "summary.json").read_text())["train/steps"] == 1
    report = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "sweep_report.py"), str(sweep_dir)],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "Failed jobs (1):" in report.stdout and "optimizer.lr=5" in report.stdout


@pytest.mark.parametrize(
    ("script", "failing"),
    [
        ("grpo_torchrl_rm.py", ["optimizer.lr=5,7", *GRPO_SMALL]),
        # refused before anything loads: the reward recipe's summary line was printed as {"eval/accuracy": NaN}
        pytest.param("reward_trainer_from_buffer.py", ["train.learning_rate=-1,-2"], marks=pytest.mark.slow),
    ],
)
def test_a_sweep_whose_jobs_run_in_other_processes_still_fails_naming_them(tmp_path, repo_root, script, failing):
    """With joblib's launcher the jobs run in worker processes: their failures still reach the sweep's exit status,
    and no failed job prints a summary."""
    sweep_dir = tmp_path / "sweep"
    command = [
        sys.executable,
        str(repo_root / "recipes" / script),
        "-m",
        *failing,
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "2 job(s) of the sweep failed" in result.stderr
    assert str(sweep_dir / "0") in result.stderr and str(sweep_dir / "1") in result.stderr
    assert "NaN" not in result.stdout and "eval/accuracy" not in result.stdout


@pytest.mark.parametrize(
    ("recipe", "preset", "schema"),
    [
        ("grpo_torchrl_rm", "grpo_lr_seed", "recipes.grpo.schema:GRPORecipeConfig"),
        ("reward_trainer_from_buffer", "reward_lr_seed", "recipes.reward.schema:RewardRecipeConfig"),
    ],
)
def test_every_sweep_preset_composes_into_a_config_its_recipe_accepts(compose_config, recipe, preset, schema):
    import importlib

    from recipes.common.schema import check_config

    module, name = schema.split(":")
    cfg = compose_config(recipe, [f"sweep={preset}", "output_dir=/tmp/unused"])
    from recipes.common.config import run_config

    check_config(run_config(cfg), getattr(importlib.import_module(module), name), recipe=recipe)
    assert cfg.logger.kind == "wandb" and cfg.hydra.mode.name == "MULTIRUN"
