"""scripts/bench_trl_tools.py: trl's own tool loop and trl with TorchRL sampling the dialogs run on equal work, each
reported, and the ratio line is the medians' ratio: structure and arithmetic, never speed (a timed assertion would
fail on a busy machine). Run on an untrained tool-calling policy built in-test."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from _tool_policy import build_tool_policy


@pytest.mark.slow  # a multi-process or benchmark run: the slow suite's (the default suite's budget is 8 minutes)
def test_quick_bench_runs_both_tool_loops_on_equal_work_and_reports_the_ratio(repo_root, tmp_path):
    build_tool_policy(tmp_path / "policy", ["Tools: multiply"])
    report_path = tmp_path / "bench.json"
    command = [
        sys.executable,
        str(repo_root / "scripts" / "bench_trl_tools.py"),
        "--quick",
        f"--policy={tmp_path / 'policy'}",
        "--completions=8",
        "--group=4",
        "--eval-prompts=4",
        f"--json={report_path}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=repo_root)
    assert result.returncode == 0, result.stderr[-3000:]
    line = r"seed 0  (trl tools=|trl \+ TorchRLRolloutFunc\(tools=\))\s.*\((\d+) tokens, (\d+) steps\)"
    runs = re.findall(line, result.stdout)
    assert sorted(side for side, _, _ in runs) == ["trl + TorchRLRolloutFunc(tools=)", "trl tools="]
    assert all(int(steps) == 2 for _, _, steps in runs)
    report = json.loads(report_path.read_text())
    medians = report["medians"]
    expected = medians["trl + TorchRLRolloutFunc(tools=)"]["tokens_per_s"] / medians["trl tools="]["tokens_per_s"]
    assert report["ratio_tokens_per_s"] == expected
    assert f"ratio   TorchRL / trl: {expected:.2f}x generated tokens/s" in result.stdout
