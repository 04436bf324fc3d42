"""How a trl-rollouts run resumes: from the newest of trl's checkpoints (``train.output_dir/checkpoint-<step>``, which
``train.save_strategy=steps`` writes), as the run it continues.

- :func:`resumed_config`: the run's own ``resolved_config.yaml`` under this command line, in this folder (trl's
  ``train.output_dir`` re-rooted with it: ``recipes.common.resume.resumed_config``).
- :func:`resume_changes`: what the resume changes, :data:`RESUME_FREE_KEYS` apart; the rest must be named in
  ``resume_allow_changes`` (``recipes.trl_grpo.checks``).
- :func:`finished_run_summary`: a run that reached ``train.max_steps`` has nothing to resume: its summary.
- :func:`record_resume_start`: before the run's records are written again, ``metrics.csv`` cut at the checkpoint's
  step (the steps after it are trained, and logged, again) and a line in ``resumes.jsonl``.

The rollout store needs nothing here: a resumed run writes a new part, which replaces the steps the killed part wrote
after the checkpoint (``recipes.trl_grpo.rollout_store.load_rollouts``); the summary covers the whole run from trl's
log history, which the checkpoint holds (``recipes.trl_grpo.report``).

Dependencies: omegaconf, transformers (``get_last_checkpoint``), the recipes' own modules.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from omegaconf import DictConfig

from recipes.common.checkpoint import latest_trl_checkpoint
from recipes.common.resume import record_resume, truncate_metrics_csv
from recipes.common.resume import resume_changes as common_resume_changes
from recipes.common.resume import resumed_config as common_resumed_config
from recipes.common.run import SUMMARY_FILE
from recipes.trl_grpo.schema import TrlGRPORecipeConfig

__all__ = [
    "RESUME_FREE_KEYS",
    "checkpoint_step",
    "finished_run_summary",
    "record_resume_start",
    "resume_changes",
    "resumed_config",
]

log = logging.getLogger(__name__)

# Settings a resumed run may change freely: where and how it runs and reports, how long it trains, how it keeps its
# records; not what it trains. Any other change (models, data, rewards, the loss, the learning rate, the batch...)
# must be named in resume_allow_changes.
RESUME_FREE_KEYS = (
    "resume",
    "overwrite",
    "resume_allow_changes",
    "output_dir",
    "logger",
    "num_threads",
    "metric",
    "rollout.store",
    "rollout.worker_resources",  # where the workers run, not what they sample
    "rollout.collector_threads",
    "ray",
    "train.output_dir",  # re-rooted in the run folder, and refused outside it
    "train.max_steps",
    "train.save_strategy",
    "train.save_steps",
    "train.save_total_limit",
    "train.logging_steps",
    "train.logging_strategy",
    "train.logging_first_step",
    "train.log_completions",
    "train.num_completions_to_print",
    "progress_bar",
    "train.ddp_timeout",
    "train.activation_checkpointing",  # recomputes the same activations: the same update
    "train.gradient_checkpointing",
    "train.push_to_hub",
    "train.hub_model_id",
    "train.hub_strategy",
    "train.hub_token",
    "train.hub_private_repo",
)
# Folders of the run that a moved or copied run folder takes with it.
_PATHS_IN_RUN = ("train.output_dir",)
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_step(checkpoint: str | Path) -> int:
    """The optimizer step a trl checkpoint (``checkpoint-<step>``) was saved at."""
    return int(_CHECKPOINT.match(Path(checkpoint).name).group(1))


def resumed_config(cfg: DictConfig) -> DictConfig:
    """The config a resumed run trains with: the run's own ``resolved_config.yaml`` under this command line, in this
    folder (``recipes.common.resume.resumed_config``); ``cfg`` itself where the folder holds neither the file nor a
    trl checkpoint (the recipe's check then says there is nothing to resume)."""
    has_checkpoint = latest_trl_checkpoint(str(cfg.train.output_dir)) is not None
    return common_resumed_config(cfg, has_checkpoint=has_checkpoint, paths_in_run=_PATHS_IN_RUN)


def resume_changes(cfg: DictConfig) -> dict:
    """The settings of ``cfg`` that differ from the run being continued, as ``{"a.b": (old, new)}``, leaving out
    those a resumed run may change freely (:data:`RESUME_FREE_KEYS`)."""
    return common_resume_changes(cfg, free_keys=RESUME_FREE_KEYS)


def finished_run_summary(cfg: TrlGRPORecipeConfig) -> dict | None:
    """With ``resume=true`` in a run whose newest trl checkpoint reached ``train.max_steps`` and that wrote its
    ``summary.json``: that summary (nothing is left to train); else None."""
    checkpoint = latest_trl_checkpoint(str(cfg.train["output_dir"])) if cfg.resume else None
    summary = Path(cfg.output_dir) / SUMMARY_FILE
    if checkpoint is not None and checkpoint_step(checkpoint) >= cfg.train["max_steps"] and summary.is_file():
        return json.loads(summary.read_text())
    return None


def record_resume_start(cfg: DictConfig, output_dir: Path) -> None:
    """Before the resumed run writes its records (``start_run``'s ``before_config``, main process): ``metrics.csv``
    cut at the checkpoint's step, and the resume (its step, what it changes against the run's records: ``cfg`` is the
    resolved config, as ``resolved_config.yaml`` holds it) in ``resumes.jsonl``."""
    step = checkpoint_step(latest_trl_checkpoint(str(cfg.train.output_dir)))
    changes = resume_changes(cfg)
    truncate_metrics_csv(output_dir / "metrics.csv", step)
    record_resume(output_dir, step=step, changes=changes)
    log.info("Resuming %s at step %d%s", output_dir, step, f" with changes {changes}" if changes else "")
