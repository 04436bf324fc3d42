"""Collects every job of a Hydra multirun into one table and one plot, failed and missing jobs included.

    python scripts/sweep_report.py multirun/2026-11-29/12-00-00
    python scripts/sweep_report.py <multirun dir> --metric eval/accuracy

Each finished job folder holds `summary.json`, `resolved_config.yaml` (whose `metric` ranks the jobs unless `--metric`
is given) and `.hydra/overrides.yaml` (the setting that distinguishes it); a job that failed holds `failed.json` (why)
instead of a summary. Prints a Markdown table (one row per finished job, sorted by the metric, then the failed jobs
and the jobs the sweep never started, counted from its `multirun.yaml`), writes it to `<multirun dir>/report.md` and
draws the metric per setting to `<multirun dir>/report.png`: the seeds of one setting as one point with their mean and
spread, on an axis scaled to the values (their differences show), so a sweep can be read without wandb.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _job_order(job: str) -> list:
    return [int(p) if p.isdigit() else p for p in Path(job).parts]


def collect(multirun_dir: Path) -> list[dict]:
    """One record per job folder: ``{"job", "overrides", "summary" or None, "failure" or None}``, in job order."""
    jobs = []
    for hydra_dir in sorted(multirun_dir.rglob(".hydra")):
        job_dir = hydra_dir.parent
        overrides_path = hydra_dir / "overrides.yaml"
        overrides = yaml.safe_load(overrides_path.read_text()) if overrides_path.exists() else []
        summary_path, failed_path = job_dir / "summary.json", job_dir / "failed.json"
        jobs.append(
            {
                "job": str(job_dir.relative_to(multirun_dir)),
                "overrides": " ".join(overrides or []) or "(defaults)",
                "override_list": list(overrides or []),
                "summary": json.loads(summary_path.read_text()) if summary_path.exists() else None,
                "failure": json.loads(failed_path.read_text())["reason"] if failed_path.exists() else None,
            }
        )
    if not any(job["summary"] is not None or job["failure"] is not None for job in jobs):
        raise SystemExit(f"sweep_report: no summary.json under {multirun_dir}; is it a finished multirun folder?")
    return sorted(jobs, key=lambda job: _job_order(job["job"]))


def expected_jobs(multirun_dir: Path) -> int | None:
    """How many jobs the sweep asked for: the product of the comma-separated choices of its command line (Hydra's
    ``multirun.yaml``), or None when it cannot be read."""
    path = multirun_dir / "multirun.yaml"
    if not path.exists():
        return None
    task = (yaml.safe_load(path.read_text()) or {}).get("hydra", {}).get("overrides", {}).get("task", [])
    count = 1
    for override in task:
        value = str(override).split("=", 1)[-1]
        if "," in value and not value.startswith(("[", "{", "'", '"')):
            count *= len(value.split(","))
    return count


def default_metric(jobs: list[dict], multirun_dir: Path) -> str:
    """The metric the recipe's ``main()`` returned (``metric`` in the job's resolved_config.yaml), else the first
    number of its summary."""
    finished = [job for job in jobs if job["summary"] is not None]
    summary = finished[0]["summary"]
    config_path = multirun_dir / finished[0]["job"] / "resolved_config.yaml"
    metric = yaml.safe_load(config_path.read_text()).get("metric") if config_path.exists() else None
    if metric in summary:
        return metric
    return next(k for k, v in summary.items() if isinstance(v, (int, float)))


def _value(job: dict, metric: str) -> float:
    value = (job["summary"] or {}).get(metric)
    return float(value) if isinstance(value, (int, float)) else float("nan")


def to_markdown(jobs: list[dict], metric: str, columns: list[str], *, missing: int = 0) -> str:
    finished = [job for job in jobs if job["summary"] is not None]
    ranked = sorted(finished, key=lambda job: -_value(job, metric) if not math.isnan(_value(job, metric)) else math.inf)
    header = ["job", "overrides", metric, *[c for c in columns if c != metric]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for job in ranked:
        values = [job["summary"].get(c, "") for c in header[2:]]
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in values]
        lines.append("| " + " | ".join([job["job"], job["overrides"], *cells]) + " |")
    failed = [job for job in jobs if job["failure"] is not None]
    unfinished = [job for job in jobs if job["summary"] is None and job["failure"] is None]
    if failed:
        lines += ["", f"Failed jobs ({len(failed)}):"]
        lines += [f"- {job['job']} ({job['overrides']}): {job['failure'].splitlines()[0]}" for job in failed]
    if unfinished or missing:
        lines += ["", f"Jobs that never finished ({len(unfinished) + missing}):"]
        lines += [f"- {job['job']} ({job['overrides']}): started, no summary.json" for job in unfinished]
        if missing:
            lines.append(f"- {missing} job(s) the sweep asked for were never started")
    return "\n".join(lines)


def group_by_setting(jobs: list[dict], metric: str) -> dict[str, list[float]]:
    """The finished jobs' metric values by setting: the overrides without the seed, so seeds fall together."""
    groups: dict[str, list[float]] = {}
    for job in jobs:
        if job["summary"] is None:
            continue
        setting = " ".join(o for o in job["override_list"] if not o.startswith("seed=")) or "(defaults)"
        groups.setdefault(setting, []).append(_value(job, metric))
    return groups


def plot(jobs: list[dict], metric: str, out: Path) -> None:
    groups = group_by_setting(jobs, metric)
    labels = list(groups)
    figure, axis = plt.subplots(figsize=(max(5, 0.9 * len(labels) + 2), 4))
    for index, label in enumerate(labels):
        values = [v for v in groups[label] if not math.isnan(v)]
        if not values:
            continue
        axis.scatter([index] * len(values), values, color="tab:blue", alpha=0.5, s=18)
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        axis.errorbar([index], [statistics.mean(values)], yerr=[spread], fmt="o", color="tab:red", capsize=4)
    axis.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    axis.set_ylabel(metric)
    axis.set_title(f"{metric} per setting (points: seeds; red: mean and standard deviation)")
    axis.margins(y=0.15)  # scaled to the values, not from 0: the differences between settings show
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
    expected = expected_jobs(args.multirun_dir)
    missing = max(0, expected - len(jobs)) if expected is not None else 0
    if not any(job["summary"] is not None for job in jobs):
        print(to_markdown(jobs, "(none finished)", [], missing=missing))
        raise SystemExit(f"sweep_report: every job of {args.multirun_dir} failed or never finished.")
    metric = args.metric or default_metric(jobs, args.multirun_dir)
    table = to_markdown(jobs, metric, args.columns, missing=missing)
    print(table)
    (args.multirun_dir / "report.md").write_text(table + "\n")
    plot(jobs, metric, args.multirun_dir / "report.png")
    print(f"\nwrote {args.multirun_dir / 'report.md'} and {args.multirun_dir / 'report.png'}")


if __name__ == "__main__":
    main()
