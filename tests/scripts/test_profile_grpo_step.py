"""scripts/profile_grpo_step.py: a profiled GRPO step of the recipe, split by phase and kind of work. Checked on the
tiny models: the split accounts for the whole step and agrees with the recipe's own phase clocks; never speed."""

from __future__ import annotations

import json
import tempfile

import pytest
from _in_process import run_script

from scripts.profile_grpo_step import CATEGORIES, FLOOR, PHASES, categorize

# The bench's quick job: groups of 4, 8 responses of 8 tokens; one warm-up step, two profiled.
QUICK = ["rollout.group_size=4", "rollout.responses_per_step=8", "rollout.generation.max_new_tokens=8"]


def test_profile_splits_the_whole_step_by_phase_and_category(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report_path = tmp_path / "profile.json"
    arguments = ["--steps=2", "--warmup=1", "--trl-step-s=1.0", f"--json={report_path}", *QUICK]
    status = run_script("scripts/profile_grpo_step.py", *arguments)
    out, err = capfd.readouterr()
    assert status == 0, err[-3000:]
    result = json.loads(report_path.read_text())
    per_step, step = result["per_step"], result["step_s"]
    assert set(per_step) == set(PHASES) and all(set(row) == set(CATEGORIES) for row in per_step.values())

    # The categories add up to the step's wall time, timed by another clock: no op counted twice, none lost.
    total = sum(sum(row.values()) for row in per_step.values())
    assert total == pytest.approx(step, rel=0.03)
    # Each phase is the recipe's own: its split adds up to what the recipe's clock measured for it.
    for phase in ("generate", "reward", "reference", "update"):
        assert sum(per_step[phase].values()) == pytest.approx(result["recipe_phases"][phase], rel=0.05, abs=2e-3)
    # The work lands where it is done: the head's products in the scoring passes and the update (the reward model
    # has no LM head), an optimizer step in the update only, the sampler's decoding in generate.
    for phase in ("generate", "reference", "update"):
        assert per_step[phase]["LM-head products"] > 0
        assert per_step[phase]["exp / softmax over [*, V]"] > 0
    assert per_step["reward"]["LM-head products"] == 0 and per_step["reward"]["backbone products"] > 0
    assert per_step["update"]["optimizer step"] > 0
    assert sum(per_step[p]["optimizer step"] for p in PHASES if p != "update") == 0

    # The floor: the products and attention as profiled plus the needed exps timed alone, below the step.
    for phase in PHASES:
        profiled = sum(per_step[phase][category] for category in FLOOR)
        assert result["floor"][phase] == pytest.approx(profiled + result["exp_floor"][phase])
    floor = sum(result["floor"].values())
    assert 0 < floor < step
    assert f"trl / floor = {1.0 / floor:.2f}x" in out


class _Event:
    """The fields of a profiler event that ``categorize`` reads."""

    def __init__(self, name, input_shapes, parent=None):
        self.name, self.input_shapes, self.cpu_parent = name, input_shapes, parent


def test_the_sampler_top_k_block_maxima_count_as_a_pass_over_the_vocabulary():
    """The sampler's top-k takes each row's block maxima over the logits viewed as [rows, V / 64, 64]: a pass over
    [*, V] though no dimension is V; the ranking of the maxima that follows is not."""
    step = _Event("phase::step", [])
    generate = _Event("phase::generate", [], parent=step)
    sizes = {"vocab": 151_936, "hidden": 512}
    assert categorize(_Event("aten::amax", [[16, 2374, 64], [], []], generate), **sizes) == (
        "generate",
        "other passes over [*, V]",
    )
    assert categorize(_Event("aten::amax", [[16, 151_936], [], []], generate), **sizes)[1] == "other passes over [*, V]"
    assert categorize(_Event("aten::topk", [[16, 2374], [], [], [], []], generate), **sizes)[1] == "other ops"
    assert categorize(_Event("aten::mul", [[16, 32, 512], [16, 32, 512]], generate), **sizes)[1] == "other ops"
