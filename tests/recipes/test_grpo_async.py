"""recipes/grpo_torchrl_rm.py with rollout.mode=async: the collector in a child process, one batch ahead, the policy
lag within its bound, failures on either side reported, and no process left behind (after a run, a crash, a SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from _in_process import ForkedScript
from _small_runs import GRPO_SMALL, REPO_ROOT, read_metrics

import recipes.grpo_torchrl_rm as recipe
from recipes.common.checkpoint import latest_checkpoint, list_checkpoints

ASYNC = [*GRPO_SMALL, "rollout.mode=async", "logger=csv"]


@pytest.fixture
def collectors(monkeypatch):
    """Every collector the recipe makes, to look at its process afterwards."""
    made = []
    make = recipe.make_collector

    def recording(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(recipe, "make_collector", recording)
    return made


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether process ``pid`` ends within ``timeout`` (a zombie, dead but not yet reaped, counts as ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_the_policy_lag_stays_within_its_bound_and_what_reward_functions_log_travels_with_the_batch(
    compose_config, tmp_path, collectors, monkeypatch
):
    """The first batch is sampled by the initial policy; with a lag of 1 allowed, every later one while the learner
    trained on the batch before (one update behind). With 0, the collector waits for each update: the withhold case
    of test_past_the_lag_bound_a_batch_is_withheld_or_thrown_away_as_set (past_lag_bound's default).

    The same run (one collector process for all three checks): the reward functions run in the collector's process,
    and their log_metric values and log_extra columns come back with the batch they scored (rollout/<name> per step, a
    column of the sample rows), as in a sync run; and wandb gets each step's train/policy_lag_histogram, every batch
    trained so far at its lag, with nothing dropped (logger=wandb also writes metrics.csv)."""
    import wandb
    from _wandb_run import StrictRun

    from recipes.common.metrics import MetricLogger

    tables, run = {}, StrictRun()
    monkeypatch.setattr(MetricLogger, "log_samples", lambda self, rows, step: tables.setdefault(step, rows))
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    overrides = [
        f"output_dir={tmp_path}",
        "train.steps=4",
        "rollout.max_policy_lag=1",
        "+reward.functions.words.function=_reward_functions.counts_words",
        "logger=wandb",
    ]
    summary = recipe.train(compose_config("grpo_torchrl_rm", [*ASYNC, *overrides]))
    rows = read_metrics(tmp_path)
    assert [row["train/policy_lag"] for row in rows] == [0.0, 1.0, 1.0, 1.0]
    assert run.dropped == []
    lags = [run.history[step]["train/policy_lag"] for step in (1, 2, 3, 4)]
    histograms = [run.history[step]["train/policy_lag_histogram"] for step in (1, 2, 3, 4)]
    assert all(isinstance(histogram, wandb.Histogram) for histogram in histograms)
    # Each step's histogram counts every batch trained so far, at its lag: the first at 0, the later ones at 1.
    assert lags == [0.0, 1.0, 1.0, 1.0]
    for step, histogram in enumerate(histograms, start=1):
        assert sum(histogram.histogram) == step
        assert histogram.bins[0] <= min(lags[:step]) and histogram.bins[-1] >= max(lags[:step])
    assert [row["rollout/withheld"] for row in rows][:2] == [0.0, 0.0]  # the second batch may use the initial weights
    assert summary["train/steps"] == 4 and summary["rollout/generated_tokens"] > 0
    (collector,) = collectors
    (pid,) = collector.pids  # rollout.backend=null in async mode: one worker process
    assert pid != os.getpid() and _gone(pid)  # its own process, stopped with the run

    assert len(rows) == 4 and all(1.0 <= row["rollout/words/mean"] <= 8.0 for row in rows)
    assert summary["rollout/words/mean_first"] == rows[0]["rollout/words/mean"]
    assert sorted(tables) == [1, 4]  # samples.every_n_steps=10: the first and the last step's samples
    for samples in tables.values():
        assert samples and all(sample["words"] == len(sample["response"].split()) for sample in samples)


@pytest.mark.parametrize("past_lag_bound", ["withhold", "resample"])
def test_past_the_lag_bound_a_batch_is_withheld_or_thrown_away_as_set(
    compose_config, tmp_path, collectors, past_lag_bound
):
    """rollout.max_policy_lag=0: every batch after the first would train one update old if sampled at once. withhold
    (the default): the collector waits for each update (rollout/withheld, rollout/withheld_s); resample: it samples at
    once and the learner throws away what arrives past the bound (rollout/resampled, at least the batch sampled right
    after the one before). Every batch trains at lag 0 either way, and the collector's process stops with the run."""
    overrides = ["train.steps=4", "rollout.max_policy_lag=0", f"rollout.past_lag_bound={past_lag_bound}"]
    summary = recipe.train(compose_config("grpo_torchrl_rm", [*ASYNC, *overrides, f"output_dir={tmp_path}"]))
    rows = read_metrics(tmp_path)
    assert [row["train/policy_lag"] for row in rows] == [0.0] * 4
    assert summary["train/steps"] == 4 and summary["rollout/generated_tokens"] > 0
    (collector,) = collectors
    (pid,) = collector.pids
    assert pid != os.getpid() and _gone(pid)
    withheld, resampled = ([row[f"rollout/{name}"] for row in rows] for name in ("withheld", "resampled"))
    if past_lag_bound == "withhold":
        assert withheld == [0.0, 1.0, 1.0, 1.0] and resampled == [0.0] * 4
        assert all(row["rollout/withheld_s"] > 0 for row in rows[1:])
    else:
        assert resampled[0] == 0.0 and all(count >= 1.0 for count in resampled[1:])
        assert withheld == [0.0] * 4 and all(row["rollout/withheld_s"] == 0.0 for row in rows)


@pytest.mark.slow  # on the test worker's shared two-node Ray cluster (tests/conftest.py), not one of its own
def test_on_ray_workers_resample_throws_away_what_arrives_past_the_bound(compose_config, tmp_path, two_node_cluster):
    """rollout.backend=ray: the learner dispatches each part itself; with resample it keeps max_policy_lag + 1 parts in
    flight with the weights it published, and throws away one that arrives past the bound."""
    cluster, _ = two_node_cluster
    overrides = ["train.steps=3", "rollout.max_policy_lag=0", "rollout.past_lag_bound=resample"]
    overrides += ["rollout.backend=ray", f"ray.address={cluster.address}", f"output_dir={tmp_path}"]
    recipe.train(compose_config("grpo_torchrl_rm", [*ASYNC, *overrides]))
    rows = read_metrics(tmp_path)
    assert [row["train/policy_lag"] for row in rows] == [0.0] * 3
    assert [row["rollout/resampled"] for row in rows] == [0.0, 1.0, 1.0]


def test_a_crash_in_the_learner_stops_the_collector(compose_config, tmp_path, collectors, monkeypatch):
    optimize = recipe.optimize
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the learner broke")
        return optimize(*args, **kwargs)

    monkeypatch.setattr(recipe, "optimize", failing)
    with pytest.raises(RuntimeError, match="the learner broke"):
        recipe.train(compose_config("grpo_torchrl_rm", [*ASYNC, f"output_dir={tmp_path}", "train.steps=4"]))
    (collector,) = collectors
    assert all(_gone(pid) for pid in collector.pids)


def test_a_crash_in_the_collector_reaches_the_learner(compose_config, tmp_path, collectors, other_rm_dir):
    """The collector process builds the reward model; its failure is raised by the learner, with its message."""
    overrides = [f"output_dir={tmp_path}", f"reward_model.name_or_path={other_rm_dir}", "reward.input=tokens"]
    with pytest.raises(RuntimeError, match="the collector process failed to start(.|\n)*two tokenizers differ"):
        recipe.train(compose_config("grpo_torchrl_rm", [*ASYNC, *overrides]))
    assert not collectors  # it never finished starting: the recipe never got it, and stopped it itself


def test_sigkill_leaves_no_process_and_the_run_resumes(compose_config, tmp_path, tmp_path_factory):
    """Killed between checkpoints, the learner takes its collector process with it; ``resume=true`` then continues
    the run from the latest checkpoint to the end, every step logged once. (The learner's process is forked from this
    one, its imports done: _in_process.ForkedScript.)"""
    overrides = [*ASYNC, "train.steps=7", "checkpoint.every_n_steps=3", "checkpoint.keep_last=null"]
    stderr_path = tmp_path_factory.mktemp("stderr") / "stderr.txt"  # beside the run's folder, which must be empty
    process = ForkedScript(
        "recipes/grpo_torchrl_rm.py",
        *overrides,
        f"hydra.run.dir={tmp_path}",
        stderr_path=stderr_path,
        env={"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
    )
    children = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            metrics = tmp_path / "metrics.csv"
            if metrics.exists() and any(row["step"] == 4.0 for row in read_metrics(tmp_path)):
                break
            time.sleep(0.02)
        assert process.poll() is None, process.stderr_text()[-3000:]
        children = psutil.Process(process.pid).children(recursive=True)
        commands = [" ".join(child.cmdline()) for child in children]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert any("multiprocessing" in command for command in commands), commands  # the collector was running
    assert all(_gone(child.pid) for child in children)
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_0000003"

    summary = recipe.train(compose_config("grpo_torchrl_rm", [*overrides, f"output_dir={tmp_path}", "resume=true"]))
    rows = read_metrics(tmp_path)
    assert summary["train/steps"] == 7
    assert [row["step"] for row in rows] == [float(s) for s in range(1, 8)]
    assert [step for step, _ in list_checkpoints(tmp_path / "checkpoints")] == [3, 6, 7]
    assert [row["train/policy_lag"] for row in rows][3:] == [0.0, 1.0, 1.0, 1.0]  # the resumed collector starts afresh


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0])
def test_async_grpo_raises_the_oracle_score(compose_config, tmp_path, seed):
    """Asynchronous collection learns as the synchronous recipe does, one update behind: the (well-formed) oracle from
    about 0 to at least 0.6 in the default run (its last value over seeds 0-4: 0.74-0.85 async, cosine schedule,
    2026-12-06, `python scripts/check_learning.py --only grpo_async`; at 2 torch threads 0.74-0.85 too)."""
    cfg = compose_config(
        "grpo_torchrl_rm", [f"output_dir={tmp_path}", "rollout.mode=async", "progress_bar=false", f"seed={seed}"]
    )
    summary = recipe.train(cfg)
    assert summary["rollout/oracle_mean_first"] < 0.3 and summary["rollout/oracle_mean_last"] >= 0.6, summary


_SLOW_MAIN = """
import functools, os, sys, time
sys.path.insert(0, {root!r})
if __name__ != "__main__":  # a spawned child importing this script again: a recipe's heavy imports take this long
    time.sleep(60)
if __name__ == "__main__":
    import torch
    from recipes.grpo.collector_modes import BackgroundCollector
    print(os.getpid(), flush=True)
    BackgroundCollector(functools.partial(time.sleep, 60), torch.nn.Linear(2, 2), start_version=0)
"""


def test_a_learner_killed_while_its_collector_starts_takes_the_collector_with_it(tmp_path):
    """The collector process sets its parent-death signal before importing anything heavy, and never re-imports the
    recipe script (nor does the fork server it is forked from, which dies with the learner while it still imports):
    killed while the child starts, the learner leaves no process behind."""
    script = tmp_path / "learner.py"
    script.write_text(_SLOW_MAIN.format(root=str(REPO_ROOT)))
    learner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(learner.stdout.readline())
        deadline = time.monotonic() + 60
        children = []
        while time.monotonic() < deadline and not children:
            children = psutil.Process(pid).children()
            time.sleep(0.05)
        assert children, "the collector process never started"
        time.sleep(1.0)  # the child is in its start-up now (the script it must not import would sleep 60 s)
        # Every process under the learner now: the fork server (importing the collector's modules) and whatever it
        # forked, or a spawned collector.
        children += [child for child in psutil.Process(pid).children(recursive=True) if child not in children]
        learner.kill()
        learner.wait(timeout=30)
        assert all(_gone(child.pid, timeout=5.0) for child in children)
    finally:
        learner.kill()


@pytest.mark.slow  # two runs, about 30 s on 2 busy cores
def test_a_zero_lag_async_run_trains_as_the_sync_run(compose_config, tmp_path):
    """With rollout.max_policy_lag=0 the async collector samples every batch with the weights the sync run samples
    with, from its own process: same seed, the same batches, so the same losses step for step (float tolerance), and
    the same responses (their lengths and rewards). Async mode changes nothing but what the lag changes. Two
    mini-batches per step: the learner's mini-batch draws must not shift the sampling noise either."""
    common = [*GRPO_SMALL, "logger=csv", "train.steps=3", "rollout.responses_per_step=8", "train.mini_batch_size=4"]
    runs = {}
    for mode in ("sync", "async"):
        folder = tmp_path / mode
        recipe.train(
            compose_config(
                "grpo_torchrl_rm", [*common, f"output_dir={folder}", f"rollout.mode={mode}", "rollout.max_policy_lag=0"]
            )
        )
        runs[mode] = read_metrics(folder)
    for sync, async_ in zip(runs["sync"], runs["async"], strict=True):
        assert async_["train/policy_lag"] == 0.0
        for key in ("rollout/reward_mean", "rollout/response_length", "train/loss", "train/grad_norm"):
            assert async_[key] == pytest.approx(sync[key], rel=1e-5, abs=1e-6), key
