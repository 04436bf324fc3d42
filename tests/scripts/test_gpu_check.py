"""scripts/gpu_check.py, part by part: what each part runs (every recipe part's command passes its recipe's checks),
how the check picks, skips and records parts, how it reads the Ray part's figures, and the Ray part itself on a CPU
worker. The whole dry run (every part on CPU, about 5 minutes) is `bash scripts/gpu_check.sh --dry-run`, whose exit
status says whether every part passed (docs/gpu_check.md); out of CI, `pytest -m dry_run` runs it and checks every
part's figures (the last test here)."""

import csv
import json
import sys
from pathlib import Path

import pytest
from _in_process import import_script

REPO_ROOT = Path(__file__).resolve().parents[2]
PARTS = (
    "versions",
    "build_models",
    "gpu_tests",
    "grpo_sync",
    "grpo_async",
    "grpo_lora",
    "grpo_gradient_checkpointing",
    "reward",
    "bench",
    "estimate_memory",
    "grpo_ray",
)
RECIPE_PARTS = {
    "grpo_sync": "grpo_torchrl_rm",
    "grpo_async": "grpo_torchrl_rm",
    "grpo_lora": "grpo_torchrl_rm",
    "grpo_gradient_checkpointing": "grpo_torchrl_rm",
    "grpo_ray": "grpo_torchrl_rm",
    "reward": "reward_trainer_from_buffer",
}


@pytest.fixture(scope="module")
def gpu_check():
    return import_script("gpu_check")


@pytest.fixture
def tiny_scratch(tmp_path):
    """A scratch folder whose models are the tiny build (what the recipes' checks read: configs and tokenizers)."""
    models = tmp_path / "scratch" / "models"
    models.mkdir(parents=True)
    (models / "policy").symlink_to(REPO_ROOT / "tiny" / "policy")
    (models / "reward_model").symlink_to(REPO_ROOT / "tiny" / "reward_model")
    return tmp_path / "scratch"


def _overrides(part, recipe: str) -> list[str]:
    """The part's Hydra overrides: its command after ``python recipes/<recipe>.py``."""
    assert part.command[1] == f"recipes/{recipe}.py", part.command
    return part.command[2:]


def test_both_modes_plan_every_part_in_order_within_the_call_limits(gpu_check, tmp_path):
    for mode in (gpu_check.GPU, gpu_check.DRY_RUN):
        parts = gpu_check.plan(mode, tmp_path)
        assert tuple(part.name for part in parts) == PARTS
        assert set(mode.budgets) == set(PARTS)
        assert {part.name for part in parts if part.needs_models} == set(PARTS[3:])
    # The GPU machine runs a command for at most 600 s: the first call's parts (install apart) and the Ray call's.
    budgets = gpu_check.GPU.budgets
    assert sum(budgets[name] for name in PARTS[:-1]) <= 540
    assert budgets["versions"] + budgets["build_models"] + budgets["grpo_ray"] <= 540


def test_every_recipe_part_of_the_dry_run_passes_its_recipes_checks(gpu_check, tiny_scratch, compose_config):
    from recipes.grpo.checks import validate as validate_grpo
    from recipes.reward.checks import validate as validate_reward

    validators = {"grpo_torchrl_rm": validate_grpo, "reward_trainer_from_buffer": validate_reward}
    for part in gpu_check.plan(gpu_check.DRY_RUN, tiny_scratch):
        if part.name not in RECIPE_PARTS:
            continue
        recipe = RECIPE_PARTS[part.name]
        overrides = [*_overrides(part, recipe), f"output_dir={tiny_scratch / 'validated' / part.name}"]
        cfg = validators[recipe](compose_config(recipe, overrides))
        assert cfg.device == "cpu", part.name
        if part.name == "grpo_ray":
            assert cfg.rollout.backend == "ray" and cfg.rollout.workers == 1 and cfg.train.steps == 2
            assert cfg.rollout.worker_resources.num_gpus == 0  # a CPU worker


def test_the_gpu_ray_part_puts_its_one_worker_on_the_gpu(gpu_check, tiny_scratch, compose_config):
    from recipes.common.config import ConfigError
    from recipes.common.rollout_backend import check_rollout_backend

    part = {part.name: part for part in gpu_check.plan(gpu_check.GPU, tiny_scratch)}["grpo_ray"]
    overrides = _overrides(part, "grpo_torchrl_rm")
    assert {"device=cuda", "dtype=bfloat16", "rollout.backend=ray", "rollout.workers=1"} <= set(overrides)
    cfg = compose_config("grpo_torchrl_rm", overrides)
    assert cfg.rollout.worker_resources.num_gpus == 1 and cfg.train.steps == gpu_check.GPU.ray_steps
    check_rollout_backend(cfg)  # the recipe's own check of where Ray workers sample (CUDA itself is not checked here)
    # ... which refuses a worker that asks Ray for no GPU while the learner is on CUDA.
    with pytest.raises(ConfigError, match="rollout.worker_resources.num_gpus=0"):
        check_rollout_backend(compose_config("grpo_torchrl_rm", [*overrides, "rollout.worker_resources.num_gpus=0"]))


def _write_ray_run(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    with (run_dir / "metrics.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = {"train/steps": len(rows), "perf/tokens_per_s": 900.0, "rollout/oracle_mean_last": 0.1}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "resolved_config.yaml").write_text(
        "device: cuda\nrollout:\n  worker_resources:\n    num_cpus: 1\n    num_gpus: 1\n    resources: {}\n"
    )


def test_the_ray_figures_are_the_workers_throughput_the_push_and_the_step_time_per_step(gpu_check, tmp_path):
    rows = [
        {
            "step": step,
            "train/loss": 0.1,
            "rollout/workers": 1.0,
            "rollout/worker_restarts": restarts,
            "rollout/worker_0/tokens_per_s": tokens_per_s,
            "perf/weight_sync_s": push_s,
            "perf/step_time_s": step_s,
        }
        for step, restarts, tokens_per_s, push_s, step_s in (
            (1, 0.0, 100.0, 0.5, 9.0),  # the first: the worker builds its collector, everything warms up
            (2, 1.0, 300.0, 0.2, 2.0),
            (3, 0.0, 500.0, 0.4, 4.0),
        )
    ]
    _write_ray_run(tmp_path / "run", rows)
    figures = gpu_check.ray_figures(tmp_path / "run")([])
    assert figures["worker_tokens_per_s"] == [100.0, 300.0, 500.0]
    assert figures["worker_tokens_per_s_mean_after_first"] == pytest.approx(400.0)
    assert figures["weight_sync_s"] == [0.5, 0.2, 0.4] and figures["weight_sync_s_mean_after_first"] == pytest.approx(
        0.3
    )
    assert figures["step_time_s_mean_after_first"] == pytest.approx(3.0)
    assert figures["worker_restarts"] == 1.0
    assert figures["device"] == "cuda" and figures["worker_resources"]["num_gpus"] == 1
    assert (
        figures["train/steps"] == 3
        and figures["perf/tokens_per_s"] == 900.0
        and "rollout/oracle_mean_last" not in figures
    )

    # A run that sampled in the learner's process has no worker column: no figures, so the part fails.
    learner_rows = [{key: value for key, value in row.items() if "worker" not in key} for row in rows]
    _write_ray_run(tmp_path / "learner_run", learner_rows)
    with pytest.raises(ValueError, match="no rollout/worker_0/tokens_per_s"):
        gpu_check.ray_figures(tmp_path / "learner_run")([])


def _earlier_call(gpu_check, scratch: Path) -> None:
    """What a first call left on the machine: the small build's model configs and a report of some parts."""
    for name in ("policy", "reward_model"):
        (scratch / "models" / name).mkdir(parents=True)
        (scratch / "models" / name / "config.json").write_text(json.dumps(gpu_check.SHAPES["small"]))
    earlier = {"versions": {"passed": True, "seconds": 1.0}, "grpo_sync": {"passed": True, "seconds": 2.0}}
    (scratch / "gpu_check.json").write_text(json.dumps({"mode": "dry-run", "parts": earlier}))


@pytest.mark.parametrize("ray_there", [False, True])
def test_only_runs_the_named_part_on_the_earlier_calls_models_beside_its_results(
    gpu_check, tmp_path, monkeypatch, ray_there
):
    ran = []

    def run_part(check, name, command, figures=None):  # records what would run, instead of running it
        ran.append(name)
        check.results[name] = {"passed": True, "seconds": 0.0}
        return True

    monkeypatch.setattr(gpu_check.Check, "part", run_part)
    monkeypatch.setattr(gpu_check, "importable", lambda module: ray_there or module != "ray")
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    _earlier_call(gpu_check, scratch)
    status = gpu_check.main(["--dry-run", "--only", "grpo_ray", "--out", str(out), "--scratch", str(scratch)])

    assert status == 0
    assert ran == (["versions", "grpo_ray"] if ray_there else ["versions"])  # the models were there: no build
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["mode"] == "dry-run" and list(report["parts"]) == ["versions", "grpo_sync", "grpo_ray"]
    assert report["parts"]["grpo_sync"] == {"passed": True, "seconds": 2.0}  # the first call's, kept
    log = (out / "gpu_check.log").read_text()
    if ray_there:
        assert "gpu_check (dry run): 3 of 3 parts passed. Figures" in log
    else:
        assert report["parts"]["grpo_ray"]["passed"] is None
        assert "gpu_wheels.sh --ray" in report["parts"]["grpo_ray"]["skipped"]
        assert "=== grpo_ray: skipped: ray cannot be imported" in log
        assert "2 of 2 parts passed; skipped: grpo_ray" in log


def test_only_builds_the_models_when_no_earlier_call_left_them(gpu_check, tmp_path, monkeypatch):
    ran = []

    def run_part(check, name, command, figures=None):
        ran.append(name)
        passed = name != "build_models"  # a build that fails: the part that needs its models is not run
        check.results[name] = {"passed": passed, "seconds": 0.0}
        return passed

    monkeypatch.setattr(gpu_check.Check, "part", run_part)
    scratch = tmp_path / "scratch"
    assert gpu_check.main(["--dry-run", "--only", "grpo_ray", "--out", str(tmp_path), "--scratch", str(scratch)]) == 1
    assert ran == ["versions", "build_models"]
    report = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert report["grpo_ray"] == {"passed": None, "skipped": "no models were built"}
    with pytest.raises(SystemExit):  # a part name that does not exist
        gpu_check.main(["--dry-run", "--only", "grpo_rays", "--out", str(tmp_path), "--scratch", str(scratch)])


@pytest.mark.slow
def test_the_ray_part_samples_on_a_cpu_worker_and_reports_its_figures(
    gpu_check, tmp_path, compose_config, two_node_cluster
):
    """The dry run's Ray part, its command's settings run in this process on the test worker's shared two-node cluster
    (a new Python starting a Ray cluster of its own cost 10-20 s more on 2 cores: the part's command line, its budget
    and its local cluster are the dry run's, `pytest -m dry_run`; Check.part's subprocess and report are tested
    above): its one worker samples on a CPU, and the part's figure reader finds every figure in the run's folder."""
    import recipes.grpo_torchrl_rm as recipe

    cluster, _ = two_node_cluster
    scratch = tmp_path / "scratch"
    assert gpu_check.build_models(scratch / "models", shape="small", device="cpu") == 0
    part = {part.name: part for part in gpu_check.plan(gpu_check.DRY_RUN, scratch)}["grpo_ray"]
    run_dir = scratch / "runs" / "grpo_ray"
    overrides = [override for override in _overrides(part, "grpo_torchrl_rm") if not override.startswith("hydra.")]
    assert f"hydra.run.dir={run_dir}" in part.command and "ray.address" not in " ".join(overrides)
    overrides += [f"output_dir={run_dir}", f"ray.address={cluster.address}"]
    recipe.train(compose_config("grpo_torchrl_rm", overrides))
    figures = part.figures([])
    assert figures["train/steps"] == 2 and figures["device"] == "cpu" and figures["worker_resources"]["num_gpus"] == 0
    assert len(figures["worker_tokens_per_s"]) == 2 and min(figures["worker_tokens_per_s"]) > 0
    assert min(figures["weight_sync_s"]) > 0 and min(figures["step_time_s"]) > 0
    assert figures["worker_restarts"] == 0


def test_a_part_over_its_budget_is_stopped_and_reported_with_its_last_lines(gpu_check, tmp_path):
    mode = gpu_check.Mode(
        device="cpu",
        dtype="float32",
        shape="small",
        grpo_steps=1,
        reward_steps=1,
        bench_args=(),
        budgets={"slow": 1, "broken": 10, "passes": 10, "no_figures": 10},
    )
    check = gpu_check.Check(tmp_path, tmp_path, mode)
    # A part that passes: its figures, read from its output's tail, go into the report (the dry run's Ray part above
    # runs in the test's process, so this is where a passing child's path is checked).
    passes = [sys.executable, "-c", "import json; print(json.dumps({'tokens_per_s': 12.5}))"]
    assert check.part("passes", passes, figures=gpu_check._json_line)
    missing = tmp_path / "missing.json"
    assert not check.part("no_figures", passes, figures=lambda _tail: json.loads(missing.read_text()))
    slow = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"]
    assert not check.part("slow", slow)
    broken = [sys.executable, "-c", "raise SystemExit('the reason it failed')"]
    assert not check.part("broken", broken)
    report = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert report["slow"]["error"][:2] == ["timed out after 1 s", "started"] and report["slow"]["seconds"] < 10
    assert report["broken"]["error"] == ["exit status 1", "the reason it failed"]
    assert report["passes"]["passed"] is True and report["passes"]["figures"] == {"tokens_per_s": 12.5}
    assert report["no_figures"]["passed"] is False and report["no_figures"]["error"][0].startswith("no figures: ")


@pytest.mark.dry_run
def test_dry_run_passes_every_part_and_writes_their_figures(tmp_path):
    """The whole dry run, every part on CPU (about 5 minutes: out of CI, which runs the parts above; run it with
    `pytest -m dry_run` or `bash scripts/gpu_check.sh --dry-run`, docs/gpu_check.md): each part passes and reports
    the figures the GPU run will give."""
    import os
    import subprocess

    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    completed = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out), "--scratch", str(tmp_path / "scratch")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    report = json.loads((out / "gpu_check.json").read_text())
    failed = {name: part.get("error") for name, part in report["parts"].items() if not part["passed"]}
    assert completed.returncode == 0 and not failed, (failed, completed.stdout[-3000:], completed.stderr[-3000:])
    assert report["mode"] == "dry-run" and tuple(report["parts"]) == PARTS
    parts = {name: part["figures"] for name, part in report["parts"].items()}

    assert parts["versions"]["unmet_requirements"] == [] and parts["versions"]["trl"].startswith("1.16")
    # The small build keeps Qwen2's family and a vocabulary past the tokenizer's, as the 0.5B build does.
    assert parts["build_models"]["shape"] == "small" and parts["build_models"]["policy_parameters"] > 0
    for run in ("grpo_sync", "grpo_async", "grpo_lora", "grpo_gradient_checkpointing"):
        assert parts[run]["train/steps"] == 2 and parts[run]["perf/tokens_per_s"] > 0, run
    assert parts["reward"]["train/steps"] == 4
    bench = parts["bench"]
    assert (
        set(bench["ratios"]) == {"ours (sync)", "ours (async)"} and bench["ratios"]["ours (sync)"]["tokens_per_s"] > 0
    )
    assert set(bench["phases"][bench["trl"]]) >= {"generate", "update", "total"}
    estimate = parts["estimate_memory"]
    assert estimate["setting"]["device"] == "cpu" and 0.5 < estimate["measured_over_estimated"] < 2.0
    log = (out / "gpu_check.log").read_text()
    assert f"gpu_check (dry run): {len(PARTS)} of {len(PARTS)} parts passed" in log
