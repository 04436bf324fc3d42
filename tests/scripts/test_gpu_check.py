"""scripts/gpu_check.sh --dry-run: every part of the GPU check runs here on CPU with small models and reports its
figures, so that the day a GPU is lent only CUDA itself is new."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
)


@pytest.mark.slow
def test_dry_run_passes_every_part_and_writes_their_figures(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    completed = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out), "--scratch", str(tmp_path / "scratch")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
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
    assert "gpu_check (dry run): 10 of 10 parts passed" in log


def test_a_part_over_its_budget_is_stopped_and_reported_with_its_last_lines(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO_ROOT / "scripts"))
    mode = gpu_check.Mode(
        device="cpu",
        dtype="float32",
        shape="small",
        grpo_steps=1,
        reward_steps=1,
        bench_args=(),
        budgets={"slow": 1, "broken": 10},
    )
    check = gpu_check.Check(tmp_path, tmp_path, mode)
    slow = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"]
    assert not check.part("slow", slow)
    broken = [sys.executable, "-c", "raise SystemExit('the reason it failed')"]
    assert not check.part("broken", broken)
    report = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert report["slow"]["error"][:2] == ["timed out after 1 s", "started"] and report["slow"]["seconds"] < 10
    assert report["broken"]["error"] == ["exit status 1", "the reason it failed"]
