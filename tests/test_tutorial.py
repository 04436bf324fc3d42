"""The executable tutorial ``docs/tutorial_trl_interop.py`` runs to the end, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial_trl_interop.py"


def test_trl_interop_tutorial_runs():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(TUTORIAL)],
        cwd=TUTORIAL.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"tutorial failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    # the walk-through reached its last step: a GRPO backward on rewards from the RewardTrainer-trained model
    assert "reward spec shape: torch.Size([4, 1, 1])" in proc.stdout
    assert "GRPO loss" in proc.stdout
