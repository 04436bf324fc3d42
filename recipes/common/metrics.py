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
import math
import os
import secrets
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from recipes.common.config import mask_override, mask_overrides_in_text

__all__ = [
    "SAMPLER_MISMATCH_THRESHOLD",
    "WANDB_ID_FILE",
    "MetricLogger",
    "barely_learned_line",
    "held_out_accuracy",
    "make_logger",
    "peak_device_memory",
    "sampler_mismatch_line",
    "sampler_mismatch_summary",
]

WANDB_ID_FILE = "wandb_run_id"

# A run whose mean |trainer - sampler log-prob| per token, averaged over its steps, is above this (a token's
# probability off by about 1% on average) reports the mismatch in summary.json and its closing line
# (docs/grpo.md#the-samplertrainer-mismatch-correction). A sampler that is the trained model itself stays
# around 1e-6; one update of lag, or a bf16 or vLLM sampler, goes above.
SAMPLER_MISMATCH_THRESHOLD = 0.01
# A run of the synthetic task (an oracle in [-1, 1]) of at least this many steps whose oracle rose less than this says
# so in its closing line, as a warning: the default runs of both GRPO recipes rise 0.75-0.97 in 20-30 steps (seeds
# 0-4) and every learning test asserts a rise of at least 0.3, so a run below it learned too little to be used as it is.
ORACLE_RISE_EXPECTED = 0.3
ORACLE_RISE_MIN_STEPS = 10
# The per-step mismatch figures both GRPO recipes log (trl's names), and how the summary folds each over the run.
_MISMATCH_MEAN = "sampling/sampling_logp_difference/mean"
_MISMATCH_FOLDS = {
    _MISMATCH_MEAN: "mean",
    "sampling/sampling_logp_difference/max": "max",
    "sampling/sampler_kl_k3": "mean",
    "sampling/importance_sampling_clipped_or_masked/token_fraction": "mean",
}


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

    def log_histogram(self, name: str, values: list[float], step: int) -> None:
        """``values`` as a wandb histogram under ``name`` (csv and none keep none: the recipe logs a scalar beside
        it). Call it before the step's :meth:`log`, which commits the step."""
        if self._wandb_run is not None and values:
            import wandb

            self._wandb_run.log({name: wandb.Histogram(values)}, step=step, commit=False)

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
            # Written beside it, then moved over it: a run killed mid-write keeps every row, and a reader (the console,
            # plot_run.py) sees the old file or the new one, never a half-written one it reads the header of twice.
            partial = self._csv_path.with_name(f".{self._csv_path.name}.partial")
            with open(partial, "w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=self._columns)
                writer.writeheader()
                writer.writerows(previous)
                writer.writerow(row)
            os.replace(partial, self._csv_path)
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


def sampler_mismatch_summary(series: dict[str, list[float]]) -> dict[str, float]:
    """The run's sampler/trainer mismatch for summary.json, from its logged per-step figures (``name -> values``):
    the mean over the steps of each (the largest, for the per-step maximum), under the same names; empty when the
    mean difference is at most :data:`SAMPLER_MISMATCH_THRESHOLD` (or was never measured).

    Examples:
        >>> sampler_mismatch_summary({"sampling/sampling_logp_difference/mean": [1e-6, 2e-6]})
        {}
        >>> sampler_mismatch_summary({"sampling/sampling_logp_difference/mean": [0.02, 0.04],
        ...                           "sampling/sampling_logp_difference/max": [0.5, 1.5]})
        {'sampling/sampling_logp_difference/mean': 0.03, 'sampling/sampling_logp_difference/max': 1.5}
    """
    folded = {}
    for name, fold in _MISMATCH_FOLDS.items():
        values = [value for value in series.get(name, []) if value == value]  # NaN: not measured that step
        if values:
            folded[name] = max(values) if fold == "max" else sum(values) / len(values)
    if folded.get(_MISMATCH_MEAN, 0.0) <= SAMPLER_MISMATCH_THRESHOLD:
        return {}
    return folded


def sampler_mismatch_line(summary: dict) -> str:
    """A sentence for the run's closing line when :func:`sampler_mismatch_summary` put the mismatch in ``summary``;
    empty otherwise."""
    if _MISMATCH_MEAN not in summary:
        return ""
    clipped = summary.get("sampling/importance_sampling_clipped_or_masked/token_fraction")
    share = ""
    if clipped is not None:
        share = f", {100 * clipped:.1f}% of tokens outside the sampler correction's clip range"
    return (
        f" Sampler/trainer mismatch: |log-prob difference| {summary[_MISMATCH_MEAN]:.3g} per token on average (above "
        f"{SAMPLER_MISMATCH_THRESHOLD}; largest {summary.get('sampling/sampling_logp_difference/max', math.nan):.3g})"
        f"{share}: the sampler's log-probs are not the trainer's (policy lag, precision or engine), which the sampler "
        "correction weighs the loss for (docs/grpo.md#the-samplertrainer-mismatch-correction)."
    )


def held_out_accuracy(summary: dict) -> str:
    """``", held-out accuracy 0.120 -> 0.640"`` for a closing line, from a summary's ``eval/accuracy`` first and last
    (a run that evaluated: the tasks with a verifier, arithmetic and calculator); empty otherwise."""
    if "eval/accuracy_last" not in summary:
        return ""
    return f", held-out accuracy {summary['eval/accuracy_first']:.3f} -> {summary['eval/accuracy_last']:.3f}"


def barely_learned_line(summary: dict) -> str:
    """A sentence for the closing line of a GRPO run on the synthetic task whose oracle rose less than
    :data:`ORACLE_RISE_EXPECTED` in at least :data:`ORACLE_RISE_MIN_STEPS` steps (a shorter run, or one without an
    oracle: empty). The recipes log the closing line as a warning when it is not empty.

    Examples:
        >>> run = {"train/steps": 30, "rollout/oracle_mean_first": -0.05}
        >>> barely_learned_line({**run, "rollout/oracle_mean_last": 0.9})
        ''
        >>> barely_learned_line({**run, "rollout/oracle_mean_last": 0.12})
        ' The oracle rose only 0.170 in 30 steps (the default run...'
    """
    if "rollout/oracle_mean_last" not in summary or summary.get("train/steps", 0) < ORACLE_RISE_MIN_STEPS:
        return ""
    rise = summary["rollout/oracle_mean_last"] - summary["rollout/oracle_mean_first"]
    if rise >= ORACLE_RISE_EXPECTED:
        return ""
    return (
        f" The oracle rose only {rise:.3f} in {summary['train/steps']} steps (the default run: 0.75-0.97; the learning "
        f"tests ask at least {ORACLE_RISE_EXPECTED}): this run barely learned the task. Try another learning rate or "
        "more steps; with LoRA on the tiny policy, target lm_head too (docs/lora.md)."
    )
