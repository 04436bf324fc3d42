"""scripts/bench_sampler_head.py: every candidate product is checked against the plain one before it is timed, and
each row count gets its line of medians and ratios: structure, never speed (a timed assertion would fail on a busy
machine)."""

from __future__ import annotations

import re

from _in_process import run_script

from interop.sampling.sampler import _packing_available


def test_a_small_head_times_every_candidate_per_row_count(capfd):
    arguments = ["--vocabulary", "4099", "--hidden", "32", "--rows", "1-2,12", "--rounds", "2", "--threads", "1"]
    status = run_script("scripts/bench_sampler_head.py", *arguments, "--pads", "2,16", "--blocks", "1024")
    stdout, stderr = capfd.readouterr()
    assert status == 0, stderr[-3000:]
    lines = {int(rows): cells for rows, cells in re.findall(r"rows\s+(\d+): (.*)", stdout)}
    names = {rows: re.findall(r"(?:^| \| )(.+?)\s+[\d.]+ \(", cells) for rows, cells in lines.items()}
    packed = ["packed"] if _packing_available() else []
    assert names == {
        1: ["mm", "head", *packed, "pad->2", "pad->16", "blocks 1024", "pad->2 blocks 1024"],
        2: ["mm", "head", *packed, "pad->16", "blocks 1024", "pad->16 blocks 1024"],
        12: ["mm", "head", *packed, "pad->16", "blocks 1024", "pad->16 blocks 1024"],
    }
    assert re.search(r"packing the weight for 16 rows \(once per sampling loop\): [\d.]+ ms", stdout) or not packed
    assert all(cells.startswith("mm ") and "(1.00)" in cells.split(" | ")[0] for cells in lines.values())
    top_k = re.findall(r"top-k at\s+(\d+) rows: topk\s+[\d.]+ \| _top_k\s+[\d.]+ \([\d.]+\)", stdout)
    assert "top-50 of the logits" in stdout and [int(rows) for rows in top_k] == [1, 2, 12]
