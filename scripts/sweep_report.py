"""Collects every job's summary.json of a Hydra multirun into one table and one plot.

    python scripts/sweep_report.py multirun/2026-11-29/12-00-00
    python scripts/sweep_report.py <multirun dir> --metric eval/accuracy

Each job folder holds `summary.json`, `resolved_config.yaml` (whose `metric` ranks the jobs unless `--metric` is given)
and `.hydra/overrides.yaml` (the setting that distinguishes it). Prints a
Markdown table (one row per job, sorted by the metric), writes it to `<multirun dir>/report.md` and draws the final
metric per setting to `<multirun dir>/report.png`, so a sweep can be read without wandb.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def collect(multirun_dir: Path) -> list[dict]:
    """One record per job: ``{"job", "overrides", "summary"}``, in job-number order."""
    jobs = []
    for summary_path in sorted(multirun_dir.rglob("summary.json")):
        job_dir = summary_path.parent
        overrides_path = job_dir / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(overrides_path.read_text()) if overrides_path.exists() else []
        jobs.append(
            {
                "job": str(job_dir.relative_to(multirun_dir)),
                "overrides": " ".join(overrides or []) or "(defaults)",
                "summary": json.loads(summary_path.read_text()),
            }
        )
    if not jobs:
        raise SystemExit(f"sweep_report: no summary.json under {multirun_dir}; is it a finished multirun folder?")
    return sorted(jobs, key=lambda job: [int(p) if p.isdigit() else p for p in Path(job["job"]).parts])


def default_metric(jobs: list[dict], multirun_dir: Path) -> str:
    """The metric the recipe's ``main()`` returned (``metric`` in the job's resolved_config.yaml), else the first
    number of its summary."""
    summary = jobs[0]["summary"]
    config_path = multirun_dir / jobs[0]["job"] / "resolved_config.yaml"
    metric = yaml.safe_load(config_path.read_text()).get("metric") if config_path.exists() else None
    if metric in summary:
        return metric
    return next(k for k, v in summary.items() if isinstance(v, (int, float)))


def to_markdown(jobs: list[dict], metric: str, columns: list[str]) -> str:
    ranked = sorted(jobs, key=lambda job: -float(job["summary"].get(metric, float("-inf"))))
    header = ["job", "overrides", metric, *[c for c in columns if c != metric]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for job in ranked:
        values = [job["summary"].get(c, "") for c in header[2:]]
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in values]
        lines.append("| " + " | ".join([job["job"], job["overrides"], *cells]) + " |")
    return "\n".join(lines)


def plot(jobs: list[dict], metric: str, out: Path) -> None:
    labels = [job["overrides"] for job in jobs]
    values = [float(job["summary"].get(metric, float("nan"))) for job in jobs]
    figure, axis = plt.subplots(figsize=(max(5, 0.9 * len(jobs) + 2), 4))
    axis.bar(range(len(jobs)), values)
    axis.set_xticks(range(len(jobs)), labels, rotation=30, ha="right", fontsize=8)
    axis.set_ylabel(metric)
    axis.set_title(f"{metric} per setting")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("multirun_dir", type=Path)
    parser.add_argument("--metric", default=None, help="summary key to rank and plot (default: the recipe's metric)")
    parser.add_argument("--columns", nargs="*", default=["perf/wall_time_s"], help="extra summary keys in the table")
    args = parser.parse_args(argv)
    jobs = collect(args.multirun_dir)
    metric = args.metric or default_metric(jobs, args.multirun_dir)
    table = to_markdown(jobs, metric, args.columns)
    print(table)
    (args.multirun_dir / "report.md").write_text(table + "\n")
    plot(jobs, metric, args.multirun_dir / "report.png")
    print(f"\nwrote {args.multirun_dir / 'report.md'} and {args.multirun_dir / 'report.png'}")


if __name__ == "__main__":
    main()
