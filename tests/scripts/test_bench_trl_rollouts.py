"""scripts/bench_trl_rollouts.py: trl's GRPOTrainer with its own generation and with TorchRL rollouts, sync and
async, run side by side on equal work, and the report compares them: structure and arithmetic, never speed (a timed
assertion would fail on a busy machine)."""

from __future__ import annotations

import json
import re

import pytest
from _in_process import run_script

SIDES = ("trl", "trl + TorchRL (sync)", "trl + TorchRL (async)")


@pytest.mark.slow  # a multi-process or benchmark run: the slow suite's (the default suite's budget is 8 minutes)
def test_quick_bench_runs_every_mode_on_equal_work_and_reports_each_ratio(tmp_path, capfd):
    report_path = tmp_path / "bench.json"
    status = run_script("scripts/bench_trl_rollouts.py", "--quick", f"--json={report_path}")  # in this process
    out, err = capfd.readouterr()
    assert status == 0, err[-3000:]
    assert "group 4, 8 completions x 8 tokens per step (every completion that long)" in out
    runs = re.findall(
        r"(warm-up|round 1)\s+(trl \+ TorchRL \((?:sync|async)\)|trl)\s.*\((\d+) tokens, (\d+) steps\)", out
    )
    assert sorted((label, side) for label, side, _, _ in runs) == sorted(
        (label, side) for label in ("warm-up", "round 1") for side in SIDES
    )
    # The same work on every side: 3 steps of 8 completions of exactly 8 tokens.
    assert all(int(tokens) == 3 * 8 * 8 and int(steps) == 3 for _, _, tokens, steps in runs)

    report = json.loads(report_path.read_text())
    medians = report["medians"]
    for mode, side in (("sync", SIDES[1]), ("async", SIDES[2])):
        assert report["ratios"][mode] == medians[side]["tokens_per_s"] / medians[SIDES[0]]["tokens_per_s"]
        line = re.search(
            rf"^trl with TorchRL rollouts \({mode}\) runs at (\d+\.\d\d)x trl's generated tokens per second", out, re.M
        )
        assert line and line.group(1) == f"{report['ratios'][mode]:.2f}", out
    best = max(report["ratios"], key=report["ratios"].get)
    assert re.search(rf"^The faster mode, {best}, (meets|misses) the target", out, re.M)
    for side in SIDES:
        phases = report["phases"][side]
        parts = sum(value for name, value in phases.items() if name != "total")
        assert abs(parts - phases["total"]) < 1e-6 * max(1.0, phases["total"])
