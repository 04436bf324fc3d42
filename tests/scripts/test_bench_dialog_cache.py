"""scripts/bench_dialog_cache.py: dialogs sampled with the KV cache kept across turns and with a prefill per turn, on
the same batches, each reported, and the ratio line is the medians' ratio: structure and arithmetic, never speed (a
timed assertion would fail on a busy machine)."""

from __future__ import annotations

import json
import re

import pytest
from _in_process import run_script


@pytest.mark.slow  # a benchmark run: the slow suite's (the default suite's budget is 8 minutes)
def test_quick_bench_samples_the_same_dialogs_both_ways_and_reports_the_ratio(tmp_path, capfd):
    report_path = tmp_path / "bench.json"
    status = run_script("scripts/bench_dialog_cache.py", "--quick", f"--json={report_path}")  # in this process
    stdout, stderr = capfd.readouterr()
    assert status == 0, stderr[-3000:]
    rounds = re.findall(r"round (\d)  (cache kept across turns|prefill per turn)\s.*\((\d+) tokens", stdout)
    assert sorted((index, way) for index, way, _ in rounds) == sorted(
        (str(index), way) for index in range(3) for way in ("cache kept across turns", "prefill per turn")
    )
    # Both ways draw with the same random numbers: the same dialogs, so the same number of tokens, every round.
    assert re.findall(r"the same dialogs both ways: (\d+)/(\d+)", stdout) == [("8", "8")] * 3
    report = json.loads(report_path.read_text())
    medians = report["medians"]
    expected = medians["cache kept across turns"]["tokens_per_s"] / medians["prefill per turn"]["tokens_per_s"]
    assert report["ratio_tokens_per_s"] == expected
    assert f"ratio   kept / prefill per turn: {expected:.2f}x generated tokens/s" in stdout
