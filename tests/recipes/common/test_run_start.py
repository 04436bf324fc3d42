"""How a run starts and reports itself, in every recipe: the output folder, the log file, the wandb run."""

from __future__ import annotations

from pathlib import Path

import pytest
from _in_process import ForkedScript, run_script
from _small_runs import GRPO_SMALL

from recipes.common.config import ConfigError
from recipes.common.run_folder import check_output_folder


def test_an_output_folder_the_run_cannot_write_fails_at_the_start(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    with pytest.raises(ConfigError, match=f"Cannot write the run's output folder {a_file / 'run'}"):
        check_output_folder(a_file / "run", overwrite=False, resume=False)
    read_only = Path("/sys/kernel")  # sysfs takes no new files, even from root (whom a chmod would not stop)
    if read_only.is_dir():
        with pytest.raises(ConfigError, match="Cannot write the run's output folder /sys/kernel"):
            check_output_folder(read_only, overwrite=False, resume=False)
    check_output_folder(tmp_path / "new" / "run", overwrite=False, resume=False)  # created, and writable
    assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())


# What the GRPO run's log file tells from start to end (formerly test_the_run_log_tells_the_run_from_start_to_end here):
# tests/recipes/test_grpo_torchrl_rm.py::test_a_run_as_a_user_starts_it, in the recipe's one run as a user starts it.


def test_a_failed_run_leaves_its_reason_in_the_log(tmp_path, capfd):
    """A bad setting: its message alone (no traceback to dig through). A failure later on: the traceback too. (The
    recipe's command line in this process: the exit status and the log are its main()'s.)"""

    def run_grpo(run_dir, *overrides):
        return run_script("recipes/grpo_torchrl_rm.py", *GRPO_SMALL, f"hydra.run.dir={run_dir}", *overrides)

    assert run_grpo(tmp_path / "bad", "rollout.group_size=1", "rollout.responses_per_step=4") == 1
    text = (tmp_path / "bad" / "grpo_torchrl_rm.log").read_text()
    assert "[ERROR] - rollout.group_size=1: GRPO normalises" in text and "Traceback" not in text
    output = capfd.readouterr()
    assert "Traceback" not in output.err + output.out

    failing = run_grpo(tmp_path / "fail", "train.steps=2", "data.oracle._target_=recipes.tasks.synthetic.no_oracle")
    assert failing == 1
    text = (tmp_path / "fail" / "grpo_torchrl_rm.log").read_text()
    assert "[ERROR] - The run failed; the traceback follows." in text
    assert "Traceback (most recent call last)" in text and "no_oracle" in text


def test_wandb_keeps_one_run_across_resumes_with_the_summary_and_sample_tables(compose_config, tmp_path, monkeypatch):
    import recipes.grpo_torchrl_rm as recipe
    from recipes.common.metrics import WANDB_ID_FILE, MetricLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    calls = {"summary": [], "samples": []}
    log_summary, log_samples = MetricLogger.log_summary, MetricLogger.log_samples

    def record_summary(self, summary):
        calls["summary"].append(dict(summary))
        log_summary(self, summary)

    def record_samples(self, rows, step):
        calls["samples"].append((step, rows))
        log_samples(self, rows, step)

    monkeypatch.setattr(MetricLogger, "log_summary", record_summary)
    monkeypatch.setattr(MetricLogger, "log_samples", record_samples)
    overrides = [*GRPO_SMALL, f"output_dir={tmp_path}", "logger=wandb", "logger.wandb.mode=offline"]
    overrides += ["checkpoint.every_n_steps=1", "samples.every_n_steps=2", "samples.log_count=3"]
    first = recipe.train(compose_config("grpo_torchrl_rm", [*overrides, "train.steps=2"]))
    run_id = (tmp_path / WANDB_ID_FILE).read_text()
    resumed = recipe.train(compose_config("grpo_torchrl_rm", [*overrides, "train.steps=3", "resume=true"]))

    assert (tmp_path / WANDB_ID_FILE).read_text() == run_id  # the same wandb run continues
    offline_runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # Each folder holds the run's log under its id (wandb names a folder offline-run-<second>-<id>, adding -1 when the
    # resume starts within the same second as the first run, which an in-process run of under a second can).
    assert len(offline_runs) == 2 and all((run / f"run-{run_id}.wandb").is_file() for run in offline_runs)
    assert [summary["train/steps"] for summary in calls["summary"]] == [2, 3]
    assert calls["summary"][0] == first and calls["summary"][1] == resumed
    assert [step for step, _ in calls["samples"]] == [1, 2, 3]  # first, every 2nd and last steps; no step twice
    assert all(
        len(rows) == 3
        and {"prompt", "response", "reward", "rewards/reward_model", "advantage", "oracle"} == set(rows[0])
        for _, rows in calls["samples"]
    )

    fresh = tmp_path / "fresh"
    recipe.train(compose_config("grpo_torchrl_rm", [*overrides, "train.steps=1", f"output_dir={fresh}"]))
    assert (fresh / WANDB_ID_FILE).read_text() != run_id  # a new run, a new wandb run


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_an_interrupted_run_says_so_with_its_last_checkpoint(tmp_path, tmp_path_factory, stop):
    import signal
    import time

    overrides = [
        *GRPO_SMALL,
        "train.steps=200",
        "checkpoint.every_n_steps=1",
        "logger=csv",
        f"hydra.run.dir={tmp_path}",
    ]
    # A command started in the background by a shell without job control (`pytest ... &`, nohup, some CI runners)
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the run would never see the
    # signal. A user's Ctrl-C reaches a foreground process; the run's process (forked from this one with its imports:
    # ForkedScript) has Python's default handlers back.
    stderr_path = tmp_path_factory.mktemp("stderr") / "stderr.txt"  # beside the run's folder, which must be empty
    process = ForkedScript("recipes/grpo_torchrl_rm.py", *overrides, stderr_path=stderr_path)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not list((tmp_path / "checkpoints").glob("step_*/training_state.pt")):
            assert process.poll() is None, process.stderr_text()[-3000:]
            time.sleep(0.05)
        process.send_signal(getattr(signal, stop))
        code = process.wait(timeout=60)
    finally:
        process.kill()
    assert code == 128 + getattr(signal, stop).value
    text = (tmp_path / "grpo_torchrl_rm.log").read_text()
    assert f"[ERROR] - The run was interrupted by {stop}. Its last checkpoint: {tmp_path}/checkpoints/step_" in text
    assert "(resume=true continues from it)" in text


def test_wandb_rows_are_committed_before_the_summary_is_written(tmp_path, monkeypatch):
    """wandb keeps a row logged with step= until the next step or finish(): flushed after the summary, the last
    step's values (perf/tokens_per_s) would replace the run's figures in the wandb run's summary."""
    import wandb
    from omegaconf import OmegaConf

    from recipes.common.metrics import MetricLogger

    events = []

    class Recording:
        summary = type("Summary", (), {"update": lambda self, values: events.append(("summary", dict(values)))})()

        def log(self, metrics, step=None, commit=None):
            events.append(("log", step, commit))

        def finish(self):
            events.append(("finish",))

    monkeypatch.setattr(wandb, "init", lambda **kwargs: Recording())
    settings = OmegaConf.create({"project": "p", "group": None, "name": None, "mode": "offline"})
    logger = MetricLogger("wandb", tmp_path, wandb_settings=settings)
    for step in (1, 2):
        logger.log({"perf/tokens_per_s": 100.0 * step}, step=step)
    logger.log_summary({"perf/tokens_per_s": 150.0})
    logger.close()
    assert events == [("log", 1, True), ("log", 2, True), ("summary", {"perf/tokens_per_s": 150.0}), ("finish",)]


def test_an_interrupted_trl_run_names_trls_last_checkpoint(tmp_path, tmp_path_factory):
    """trl keeps its checkpoints in train.output_dir (<run>/trainer/checkpoint-N): the message names the newest."""
    import signal
    import time

    overrides = [
        "train.max_steps=200",
        "train.per_device_train_batch_size=8",
        "rollout.group_size=4",
        "rollout.generation.max_new_tokens=8",
        "data.num_train_prompts=16",
        "rollout.prompts_per_draw=8",
        "train.save_strategy=steps",
        "train.save_steps=1",
        f"hydra.run.dir={tmp_path}",
    ]
    stderr_path = tmp_path_factory.mktemp("stderr") / "stderr.txt"
    process = ForkedScript("recipes/trl_grpo_torchrl_rollouts.py", *overrides, stderr_path=stderr_path)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not list((tmp_path / "trainer").glob("checkpoint-*/trainer_state.json")):
            assert process.poll() is None, process.stderr_text()[-3000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    finally:
        process.kill()
    assert code == 128 + signal.SIGTERM.value
    text = (tmp_path / "trl_grpo_torchrl_rollouts.log").read_text()
    assert f"The run was interrupted by SIGTERM. Its last checkpoint: {tmp_path}/trainer/checkpoint-" in text
