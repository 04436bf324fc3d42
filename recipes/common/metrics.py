"""Metric logging for the recipes, chosen with ``logger=none|csv|wandb``.

Every logger takes namespaced metric dicts (``train/loss``, ``rollout/reward_mean``...) with a step. ``csv`` appends
to ``metrics.csv`` in the run folder (readable without any service); ``wandb`` also writes there and logs to
Weights & Biases with project/group/name/mode from the config (``mode: offline`` works with no account). Use it as a
context manager, or call ``close()`` in a ``finally``: Hydra multirun jobs share one process, and a run left open
would swallow the next job's metrics.

A wandb run's id is kept in the run folder (``wandb_run_id``): a resumed run (``resume=True``) logs to the same
wandb run, from the step it continues at.
"""

from __future__ import annotations

import contextlib
import csv
import secrets
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from recipes.common.config import mask_override, mask_overrides_in_text

__all__ = ["WANDB_ID_FILE", "MetricLogger", "held_out_accuracy", "make_logger", "peak_device_memory"]

WANDB_ID_FILE = "wandb_run_id"


@contextlib.contextmanager
def _command_line_masked():
    """``sys.argv`` with every secret given in clear masked (``+train.hub_token=hf_...``), while wandb reads it."""
    saved = list(sys.argv)
    sys.argv[:] = [mask_override(argument) for argument in saved]
    try:
        yield
    finally:
        sys.argv[:] = saved


class MetricLogger:
    """Writes metrics to ``<run_dir>/metrics.csv`` (unless ``kind == "none"``) and to wandb when ``kind == "wandb"``."""

    def __init__(
        self,
        kind: str,
        run_dir: Path,
        *,
        wandb_settings: DictConfig | None = None,
        config=None,
        resume: bool = False,
    ) -> None:
        if kind not in ("none", "csv", "wandb"):
            raise ValueError(f"MetricLogger: kind must be 'none', 'csv' or 'wandb', got {kind!r}.")
        self.kind = kind
        self._csv_path = Path(run_dir) / "metrics.csv" if kind != "none" else None
        self._columns: list[str] | None = None  # the CSV header, the union of every metric logged so far
        self._wandb_run = None
        if kind == "wandb":
            import wandb

            id_file = Path(run_dir) / WANDB_ID_FILE
            resuming = resume and id_file.is_file()
            run_id = id_file.read_text().strip() if resuming else secrets.token_hex(4)
            id_file.write_text(run_id)
            with _command_line_masked():  # wandb records sys.argv with the run
                self._wandb_run = wandb.init(
                    id=run_id,
                    resume="allow" if resuming else None,
                    project=wandb_settings.project,
                    group=wandb_settings.group,
                    # A sweep preset names each run by its overrides (${hydra:job.override_dirname}).
                    name=mask_overrides_in_text(wandb_settings.name) if wandb_settings.name else None,
                    mode=wandb_settings.mode,
                    dir=str(run_dir),
                    config=OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else config,
                    reinit="finish_previous",
                )

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if self._csv_path is not None:
            self._append_csv(row)
        if self._wandb_run is not None:
            # Committed now: a row wandb still held would be flushed at finish(), after the summary, and its values
            # (the last step's perf/tokens_per_s...) would replace the run's own figures in the wandb summary.
            self._wandb_run.log(metrics, step=step, commit=True)

    def log_samples(self, rows: list[dict], step: int) -> None:
        """A table of sample rollouts (one dict per row, the same keys in each) under ``samples`` in wandb, as
        trl's completions table; csv and none keep no samples (the recipe prints a few in its log). Call it before
        the step's :meth:`log`, which commits the step: wandb refuses anything logged to a committed step."""
        if self._wandb_run is not None and rows:
            import wandb

            columns = list(rows[0])
            table = wandb.Table(columns=["step", *columns], data=[[step, *(row[c] for c in columns)] for row in rows])
            self._wandb_run.log({"samples": table}, step=step, commit=False)

    def log_summary(self, summary: dict) -> None:
        """The run's final figures, in the wandb run's summary (a csv run has them in the recipe's summary.json)."""
        if self._wandb_run is not None:
            self._wandb_run.summary.update(summary)

    def _append_csv(self, row: dict[str, float]) -> None:
        new_columns = [k for k in row if k not in (self._columns or [])]
        if self._columns is None and self._csv_path.exists():
            # Resuming a run: keep appending under the header already on disk.
            with open(self._csv_path, newline="") as handle:
                self._columns = next(csv.reader(handle), [])
            new_columns = [k for k in row if k not in self._columns]
        if new_columns or self._columns is None:
            # A metric first seen now (an eval every N steps, say): rewrite the file under the union of the columns,
            # so no value is dropped and every row stays aligned with the header.
            previous = []
            if self._csv_path.exists():
                with open(self._csv_path, newline="") as handle:
                    previous = list(csv.DictReader(handle))
            self._columns = [*(self._columns or []), *new_columns]
            with open(self._csv_path, "w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=self._columns)
                writer.writeheader()
                writer.writerows(previous)
                writer.writerow(row)
            return
        with open(self._csv_path, "a", newline="") as handle:
            csv.DictWriter(handle, fieldnames=self._columns).writerow(row)

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def make_logger(logger_cfg: DictConfig, run_dir: Path, *, config=None, resume: bool = False) -> MetricLogger:
    """The logger a ``logger=`` config node asks for; ``resume``: continue the run folder's wandb run."""
    return MetricLogger(logger_cfg.kind, run_dir, wandb_settings=logger_cfg.get("wandb"), config=config, resume=resume)


def peak_device_memory(device) -> dict[str, float]:
    """``perf/peak_cuda_memory_gib``: the most CUDA memory this process's tensors held at once over the run (PyTorch's
    allocator, ``torch.cuda.max_memory_allocated``), for summary.json; empty off CUDA, where no such counter exists."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    # "cuda" without an index is the process's current device (its rank's, under torchrun).
    peak = torch.cuda.max_memory_allocated(device if device.index is not None else None)
    return {"perf/peak_cuda_memory_gib": peak / 2**30}


def held_out_accuracy(summary: dict) -> str:
    """``", held-out accuracy 0.120 -> 0.640"`` for a closing line, from a summary's ``eval/accuracy`` first and last
    (a run that evaluated: the tasks with a verifier, arithmetic and calculator); empty otherwise."""
    if "eval/accuracy_last" not in summary:
        return ""
    return f", held-out accuracy {summary['eval/accuracy_first']:.3f} -> {summary['eval/accuracy_last']:.3f}"
