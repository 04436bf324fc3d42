"""scripts/plot_run.py and scripts/sweep_report.py on run folders laid out as the recipes write them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _write_run(run_dir, rewards, overrides, metric_value):
    run_dir.mkdir(parents=True)
    lines = ["step,rollout/reward_mean,rollout/oracle_mean,train/kl_to_ref"]
    lines += [f"{i},{r},{r / 2},{0.01 * i}" for i, r in enumerate(rewards, start=1)]
    (run_dir / "metrics.csv").write_text("\n".join(lines) + "\n")
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    # As the recipes write them: the metric main() returns is named in the resolved config, not in the summary.
    (run_dir / "resolved_config.yaml").write_text("metric: rollout/oracle_mean_last\n")
    summary = {"perf/wall_time_s": 12.5, "rollout/oracle_mean_last": metric_value}
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_plot_run_draws_the_curves(tmp_path, repo_root):
    _write_run(tmp_path / "run", [0.1, 0.3, 0.6], ["seed=0"], 0.3)
    result = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "plot_run.py"), str(tmp_path / "run")],
        check=True,
        capture_output=True,
        text=True,
    )
    png = tmp_path / "run" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rollout/reward_mean, rollout/oracle_mean, train/kl_to_ref" in result.stdout


def test_plot_run_explains_a_missing_metrics_file(tmp_path, repo_root):
    result = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "plot_run.py"), str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode != 0 and "logger=csv" in result.stderr


def test_sweep_report_ranks_jobs_by_the_recipe_metric(tmp_path, repo_root):
    sys.path.insert(0, str(repo_root / "scripts"))
    try:
        import sweep_report
    finally:
        sys.path.pop(0)
    _write_run(tmp_path / "0", [0.1], ["grpo.lr=1e-4", "seed=0"], 0.2)
    _write_run(tmp_path / "1", [0.1], ["grpo.lr=3e-4", "seed=0"], 0.5)
    _write_run(tmp_path / "10", [0.1], ["grpo.lr=1e-3", "seed=0"], 0.4)
    sweep_report.main([str(tmp_path)])
    rows = (tmp_path / "report.md").read_text().splitlines()
    assert rows[0] == "| job | overrides | rollout/oracle_mean_last | perf/wall_time_s |"
    assert [row.split(" | ")[0] for row in rows[2:]] == ["| 1", "| 10", "| 0"]
    assert "grpo.lr=3e-4 seed=0" in rows[2]
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="no summary.json"):
        sweep_report.main([str(tmp_path / "0" / ".hydra")])


def test_sweep_report_lists_failed_and_missing_jobs_and_groups_seeds(tmp_path, repo_root):
    sys.path.insert(0, str(repo_root / "scripts"))
    try:
        import sweep_report
    finally:
        sys.path.pop(0)
    _write_run(tmp_path / "0", [0.1], ["optimizer.lr=1e-3", "seed=0"], 0.50)
    _write_run(tmp_path / "1", [0.1], ["optimizer.lr=1e-3", "seed=1"], 0.54)
    _write_run(tmp_path / "2", [0.1], ["optimizer.lr=3e-3", "seed=0"], 0.61)
    (tmp_path / "2" / "summary.json").unlink()
    (tmp_path / "2" / "failed.json").write_text(json.dumps({"reason": "optimizer.lr=3e-3 diverged"}))
    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task:\n    - optimizer.lr=1e-3,3e-3\n    - seed=0,1\n"
    )
    sweep_report.main([str(tmp_path)])
    report = (tmp_path / "report.md").read_text()
    assert "Failed jobs (1):\n- 2 (optimizer.lr=3e-3 seed=0): optimizer.lr=3e-3 diverged" in report
    assert "1 job(s) the sweep asked for were never started" in report
    groups = sweep_report.group_by_setting(sweep_report.collect(tmp_path), "rollout/oracle_mean_last")
    assert groups == {"optimizer.lr=1e-3": [0.50, 0.54]}  # the two seeds of one setting, together
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
