"""The learning pins of the slow suite, run over seeds and torch thread counts: does each margin hold on any seed?

A learning test runs one seed (CI's time is short) and asserts a margin; a margin measured on one seed of one machine
is no margin (CPU kernels and thread counts change the reduction order, so the same commit follows other trajectories
on other machines of the same kind). This script runs each pinned configuration on every seed and thread count asked,
prints what it reached, and exits 1 if any run falls short of the test's margin. The figures it prints are the ones a
learning test's docstring quotes.

    python scripts/check_learning.py                              # every check, seeds 0-4, 1 and 2 threads
    python scripts/check_learning.py --only grpo_default grpo_loss_dapo --seeds 0 1 --threads 1
    python scripts/check_learning.py --list

Each run is the recipe's own command (``python recipes/<recipe>.py ...``) in a fresh process with its own run folder
under ``--out``, read back from its ``summary.json``. ``--jobs 2`` runs two at once (each recipe uses ``num_threads``
cores).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Check:
    """One pinned configuration: ``measure`` of its ``summary.json`` must reach ``margin``.

    ``measure``: ``"rise:<metric>"`` (``<metric>_last - <metric>_first``) or ``"last:<metric>"`` (``<metric>_last``).
    ``test``: the test that asserts it.
    """

    recipe: str
    overrides: tuple[str, ...]
    measure: str
    margin: float
    test: str
    extra: dict = field(default_factory=dict)

    def value(self, summary: dict) -> float:
        kind, metric = self.measure.split(":", 1)
        if kind == "rise":
            return summary[f"{metric}_last"] - summary[f"{metric}_first"]
        return summary[f"{metric}_last"]


_LOSS_VARIANTS = {
    "grpo": ["loss.type=grpo"],
    "bnpo": ["loss.type=bnpo"],
    "dr_grpo": ["loss.type=dr_grpo"],
    "dapo": ["loss.type=dapo"],
    "sapo": ["loss.type=sapo"],
    "luspo": ["loss.type=luspo"],
    "cispo": ["loss.type=cispo", "loss.clip_epsilon_high=1.28"],
    "gspo": ["loss.type=grpo", "loss.importance_sampling_level=sequence"],
    "clip_higher": ["loss.clip_epsilon_high=0.28"],
    "filter_zero_std": ["advantage.filter_zero_std_groups=true"],
    "vespo": ["loss.type=vespo"],
}
_TINY_LORA = (
    "model.lora={r:16,alpha:32,dropout:0.0,"
    "target_modules:[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]}"
)
_ALGORITHM = "tests/recipes/grpo/test_algorithm.py"
_DEFAULT_RUN_TEST = "tests/recipes/test_grpo_torchrl_rm.py::test_the_default_run_ends_stable"
# bnpo and vespo: CI runs one seed; out of CI (`pytest -m seeds`) their mean over seeds 0 and 1 must reach 0.4 too.
_TWO_SEED_MEAN = " (and the mean of seeds 0 and 1 >= 0.4, pytest -m seeds: ::test_loss_types_slower_on_some_seeds_...)"

CHECKS: dict[str, Check] = {
    "grpo_default_20_steps": Check(
        "grpo_torchrl_rm",
        ("train.steps=20", "summary.window=3"),
        "rise:rollout/oracle_mean",
        0.3,
        "tests/recipes/test_grpo_torchrl_rm.py::test_grpo_raises_the_oracle_score",
    ),
    **{
        f"grpo_loss_{name}": Check(
            "grpo_torchrl_rm",
            tuple(overrides),
            "rise:rollout/oracle_mean",
            0.4,
            # dapo is the default loss type: its run is the default run's test.
            _DEFAULT_RUN_TEST
            if name == "dapo"
            else f"{_ALGORITHM}::test_every_loss_type_learns_the_default_task"
            + (_TWO_SEED_MEAN if name == "vespo" else ""),
        )
        for name, overrides in _LOSS_VARIANTS.items()
        if name != "bnpo"
    },
    "grpo_loss_bnpo": Check(
        "grpo_torchrl_rm",
        tuple(_LOSS_VARIANTS["bnpo"]),
        "rise:rollout/oracle_mean",
        0.3,
        f"{_ALGORITHM}::test_bnpo_learns_the_default_task" + _TWO_SEED_MEAN,
    ),
    "grpo_async": Check(
        "grpo_torchrl_rm",
        ("rollout.mode=async",),
        "last:rollout/oracle_mean",
        0.6,
        "tests/recipes/test_grpo_async.py::test_async_grpo_raises_the_oracle_score",
    ),
    "grpo_bf16_sampler": Check(
        "grpo_torchrl_rm",
        (
            "rollout.backend=processes",
            "rollout.sampler_dtype=bfloat16",
            "loss.sampler_correction.enabled=true",
            "loss.sampler_correction.mode=token_truncate",
        ),
        "rise:rollout/oracle_mean",
        0.6,
        "tests/recipes/grpo/test_grpo_sampler_correction.py::test_a_bf16_sampler_with_the_correction_learns_the_default_task",
    ),
    "grpo_lora": Check(
        "grpo_torchrl_rm",
        (_TINY_LORA, "logger=none"),
        "last:rollout/oracle_mean",
        0.7,
        "tests/recipes/test_lora.py::test_lora_grpo_on_the_tiny_defaults_learns",
    ),
    "trl_default": Check(
        "trl_grpo_torchrl_rollouts",
        (),
        "rise:rollout/oracle_mean",
        0.6,
        "tests/recipes/test_trl_grpo_torchrl_rollouts.py::test_the_default_run_raises_the_oracle",
    ),
    # experiment=calculator in 20 steps of the preset's 30 (the cosine schedule over 20): the tests' runs, in CI's
    # budget.
    "grpo_calculator_20_steps": Check(
        "grpo_torchrl_rm",
        ("experiment=calculator", "train.steps=20"),
        "last:eval/accuracy",
        0.7,
        "tests/recipes/grpo/test_tools_calculator.py::test_the_calculator_task_is_learned_on_seed_0",
    ),
    "trl_calculator_20_steps": Check(
        "trl_grpo_torchrl_rollouts",
        ("experiment=calculator", "train.max_steps=20"),
        "last:eval/accuracy",
        0.8,
        "tests/recipes/trl_grpo/test_trl_recipe_tools.py::"
        "test_experiment_calculator_learns_to_use_its_tool_on_every_seed_in_the_trl_recipe",
    ),
}


def run_one(name: str, check: Check, seed: int, threads: int, out: Path) -> tuple[str, int, int, float | None, str]:
    """Runs ``check`` once; returns (name, seed, threads, its value or None, the error's last line)."""
    run_dir = out / name / f"seed{seed}_threads{threads}"
    command = [
        sys.executable,
        str(ROOT / "recipes" / f"{check.recipe}.py"),
        *check.overrides,
        f"seed={seed}",
        f"num_threads={threads}",
        "progress_bar=false",
        f"hydra.run.dir={run_dir}",
        "overwrite=true",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return name, seed, threads, None, lines[-1] if lines else f"exit {done.returncode}"
    summary = json.loads((run_dir / "summary.json").read_text())
    return name, seed, threads, check.value(summary), ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(CHECKS), help="these checks (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="torch thread counts (num_threads)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--out", type=Path, default=None, help="where the run folders go (default: a temporary one)")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    args = parser.parse_args(argv)
    names = args.only or list(CHECKS)
    if args.list:
        for name in names:
            check = CHECKS[name]
            command = " ".join([check.recipe, *check.overrides])
            print(f"{name}: {command} -> {check.measure} >= {check.margin} ({check.test})")
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="check_learning."))
    jobs = [(name, seed, threads) for name in names for seed in args.seeds for threads in args.threads]
    print(f"{len(jobs)} runs, run folders under {out}", flush=True)
    results: dict[str, list[tuple[int, int, float | None, str]]] = {name: [] for name in names}
    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, name, CHECKS[name], seed, threads, out) for name, seed, threads in jobs]
        for future in concurrent.futures.as_completed(futures):
            name, seed, threads, value, error = future.result()
            results[name].append((seed, threads, value, error))
            shown = f"{value:+.3f}" if value is not None else f"failed: {error}"
            print(f"  {name} seed={seed} threads={threads}: {shown}", flush=True)
    print(f"\n{time.time() - start:.0f} s. Per check: value per seed (threads ...), the smallest, the margin:")
    short = 0
    for name in names:
        check = CHECKS[name]
        rows = sorted(results[name])
        values = [value for _, _, value, _ in rows if value is not None]
        per_seed = "; ".join(
            f"{seed}: "
            + " ".join(f"{value:.2f}" if value is not None else "fail" for s, _, value, _ in rows if s == seed)
            for seed in args.seeds
        )
        smallest = min(values) if values else float("nan")
        failed = len(values) < len(rows) or smallest < check.margin
        short += failed
        verdict = "SHORT" if failed else "holds"
        print(f"{name:26s} {check.measure:28s} {per_seed}  min {smallest:.2f} vs {check.margin}  {verdict}")
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
