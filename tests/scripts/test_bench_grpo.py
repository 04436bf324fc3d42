"""scripts/bench_grpo.py: the recipe and trl's GRPOTrainer run side by side and the table compares them."""

from __future__ import annotations

import re
import subprocess
import sys

NUMBER = r"(\d+(?:\.\d+)?)"


def test_quick_bench_prints_both_sides_and_their_ratio(repo_root):
    result = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "bench_grpo.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo_root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout

    # The quick configuration is the one both sides report running: groups of 4, 8 responses of at most 8 tokens.
    assert "group 4, 8 responses per generation batch, 1 optimizer step(s) of 8 per batch, max_new_tokens 8" in out
    assert "every response max_new_tokens long" in out
    # Both sides do the same work: every response is max_new_tokens (8) long, warm-up included.
    runs = re.findall(r"(warm-up|round 1)\s+(ours|trl)\s.*\((\d+) tokens, (\d+) steps\)", out)
    assert sorted((label, side) for label, side, _, _ in runs) == [
        ("round 1", "ours"),
        ("round 1", "trl"),
        ("warm-up", "ours"),
        ("warm-up", "trl"),
    ]
    for _, _, tokens, steps in runs:
        assert int(steps) == 2  # --quick: 2 generation batches, one optimizer step each
        assert int(tokens) == 2 * 8 * 8  # 2 batches of 8 responses of 8 tokens

    rows = {}
    for name in ("ours", "trl"):
        match = re.search(rf"^{name}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$", out, re.MULTILINE)
        assert match, f"no table row for {name} in:\n{out}"
        rows[name] = [float(v) for v in match.groups()]
        assert all(v > 0 for v in rows[name])
    ratio = re.search(rf"^ratio ours/trl\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$", out, re.MULTILINE)
    assert ratio, out
    # The ratios are the rows' quotients (printed to 2 decimals).
    for column, value in enumerate(float(v) for v in ratio.groups()):
        expected = rows["ours"][column] / rows["trl"][column]
        assert abs(value - expected) <= 0.006 + 0.01 * expected
    assert rows["ours"][3] == rows["trl"][3] == 8.0  # tokens per response
    assert "trl's generated tokens per second of training" in out and "target >= 1.00x" in out
