"""The executable tutorial ``docs/tutorial_trl_interop.py`` runs to the end, as a user runs it (``python
docs/tutorial_trl_interop.py``, its ``__main__`` in this process: a process of its own spent 4-5 s importing torch,
transformers and torchrl again)."""

from __future__ import annotations

from pathlib import Path

from _in_process import run_script

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial_trl_interop.py"


def test_trl_interop_tutorial_runs(capfd):
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    returncode = run_script(TUTORIAL, env=env, cwd=TUTORIAL.parents[1])
    output = capfd.readouterr()
    assert returncode == 0, f"tutorial failed:\n{output.out[-3000:]}\n{output.err[-5000:]}"
    # the walk-through reached its last step: a GRPO backward on rewards from the RewardTrainer-trained model
    assert "reward spec shape: torch.Size([4, 1, 1])" in output.out
    assert "GRPO loss" in output.out
