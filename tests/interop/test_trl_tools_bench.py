"""scripts/bench_trl_tools.py: trl's own tool loop and trl with TorchRL sampling the dialogs run on equal work, each
reported, and the ratio line is the medians' ratio: structure and arithmetic, never speed (a timed assertion would
fail on a busy machine). Run on an untrained tool-calling policy built in-test."""

from __future__ import annotations

import json
import re

import pytest
from _in_process import run_script
from _tool_policy import build_tool_policy


@pytest.mark.slow  # a multi-process or benchmark run: the slow suite's (the default suite's budget is 8 minutes)
def test_quick_bench_runs_both_tool_loops_on_equal_work_and_reports_the_ratio(tmp_path, capfd):
    build_tool_policy(tmp_path / "policy", ["Tools: multiply"])
    report_path = tmp_path / "bench.json"
    arguments = [
        "--quick",
        f"--policy={tmp_path / 'policy'}",
        "--completions=8",
        "--group=4",
        "--eval-prompts=4",
        f"--json={report_path}",
    ]
    status = run_script("scripts/bench_trl_tools.py", *arguments)  # in this process: its command line is not tested
    stdout, stderr = capfd.readouterr()
    assert status == 0, stderr[-3000:]
    line = r"seed 0  (trl tools=|trl \+ TorchRLRolloutFunc\(tools=\))\s.*\((\d+) tokens, (\d+) steps\)"
    runs = re.findall(line, stdout)
    assert sorted(side for side, _, _ in runs) == ["trl + TorchRLRolloutFunc(tools=)", "trl tools="]
    assert all(int(steps) == 2 for _, _, steps in runs)
    report = json.loads(report_path.read_text())
    medians = report["medians"]
    expected = medians["trl + TorchRLRolloutFunc(tools=)"]["tokens_per_s"] / medians["trl tools="]["tokens_per_s"]
    assert report["ratio_tokens_per_s"] == expected
    assert f"ratio   TorchRL / trl: {expected:.2f}x generated tokens/s" in stdout
