"""Draws a run's learning curves (reward, oracle score, KL to the reference) from its metrics.csv to a PNG.

python scripts/plot_run.py outputs/2026-11-29/12-00-00            # writes <run dir>/curves.png
python scripts/plot_run.py <run dir> --out curves.png --metrics rollout/reward_mean train/loss
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT_METRICS = ("rollout/reward_mean", "rollout/oracle_mean", "train/kl_to_ref")


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``metrics.csv`` as ``{metric: [(step, value), ...]}``, empty cells skipped."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        raise SystemExit(f"plot_run: {path} does not exist; run the recipe with logger=csv (or wandb) to write it.")
    curves: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            step = int(float(row["step"]))
            for key, value in row.items():
                if key != "step" and value not in ("", None) and not math.isnan(float(value)):
                    curves.setdefault(key, []).append((step, float(value)))
    return curves


def plot_curves(curves: dict[str, list[tuple[int, float]]], metrics: list[str], out: Path, title: str) -> list[str]:
    """Draws one panel per metric present in ``curves``; returns the metrics drawn."""
    present = [m for m in metrics if m in curves]
    if not present:
        raise SystemExit(f"plot_run: none of {metrics} in the metrics file; it has {sorted(curves)}.")
    figure, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 3.5), squeeze=False)
    for axis, metric in zip(axes[0], present):
        steps, values = zip(*curves[metric])
        axis.plot(steps, values, marker="." if len(steps) < 50 else None)
        axis.set_title(metric)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return present


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: <run dir>/curves.png)")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    args = parser.parse_args(argv)
    out = args.out or args.run_dir / "curves.png"
    drawn = plot_curves(read_metrics(args.run_dir), args.metrics, out, title=str(args.run_dir))
    print(f"wrote {out} ({', '.join(drawn)})")


if __name__ == "__main__":
    main()
