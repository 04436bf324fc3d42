"""GRPO's checkpoints and resume: what a checkpoint holds beyond the model, how a run continues from one.

A checkpoint is the folder ``recipes.common.checkpoint`` lays out (``<root>/step_<N>``, written atomically). GRPO
puts in it:

- ``model/``: the policy (for a LoRA policy the adapter only) and its tokenizer; with ``checkpoint.save_merged``
  also ``merged_model/``, the adapters merged into a full model (:func:`save_merged_model_folder`);
- ``training_state.pt``: the optimizer state, the step, every rank's RNG state and the run's progress
  (:class:`TrainingProgress`): only tensors, numbers, strings, lists and dicts, so that it loads with
  ``torch.load(weights_only=True)`` (:func:`load_training_state`).

A resumed run trains as the run it continues: :func:`resume_changes` lists what its settings change against the
run's ``resolved_config.yaml`` (:data:`RESUME_FREE_KEYS` may change freely), :func:`record_resume` keeps a line per
resume in ``resumes.jsonl``, :func:`truncate_metrics_csv` drops the rows logged after the checkpoint (those, and
:func:`resumed_config`'s restoring of the run's settings, are every resuming recipe's: ``recipes.common.resume``).
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import random
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from recipes.common.checkpoint import (
    MERGED_MODEL_FOLDER,
    MODEL_FOLDER,
    STATE_FILE,
    broken_checkpoint_advice,
    check_manifest,
    checkpoint_folder,
    latest_checkpoint,
    list_checkpoints,
    save_model_folder,
    write_folder_atomically,
    write_manifest,
)
from recipes.common.config import ConfigError, RunStopped
from recipes.common.models import merge_adapters
from recipes.common.resume import (
    RESUMES_FILE,
    config_changes,
    read_metrics_rows,
    record_resume,
    truncate_metrics_csv,
)
from recipes.common.resume import resume_changes as common_resume_changes
from recipes.common.resume import resumed_config as common_resumed_config
from recipes.common.schema import ModelNode
from recipes.grpo.schema import GRPORecipeConfig

__all__ = [
    "REFERENCE_FOLDER",
    "RESUMES_FILE",
    "RESUME_FREE_KEYS",
    "TrainingProgress",
    "capture_rng_state",
    "checkpoint_policy_node",
    "checkpoint_root",
    "config_changes",
    "finished_run_summary",
    "load_training_state",
    "prune_checkpoints",
    "read_metrics_rows",
    "record_resume",
    "restore_rng_state",
    "resume_changes",
    "resumed_config",
    "save_checkpoint",
    "save_merged_model_folder",
    "truncate_metrics_csv",
]

REFERENCE_FOLDER = "reference_model"  # loss.sync_ref_model: the reference as it moved
# Settings a resumed run may change freely: where and how it runs and reports, not what it trains. Any other change
# (group size, batch sizes, models, data, learning rate...) must be named in resume_allow_changes.
RESUME_FREE_KEYS = (
    "resume",
    "overwrite",
    "resume_allow_changes",
    "output_dir",
    "logger",
    "progress_bar",
    "log_every_n_steps",
    "samples",
    "num_threads",
    "train.steps",
    "train.gradient_checkpointing",  # recomputes the same activations: the same update
    "checkpoint",
    "summary",
    "metric",
    "rollout.collector_threads",
    "rollout.learner_sampling_threads",
    "rollout.worker_resources",  # where the workers run, not what they sample
    "ray",
    "rollout.log_prob_micro_batch_size",
    "reward.micro_batch_size",
)


@dataclass
class TrainingProgress:
    """The running totals of a GRPO run, saved in every checkpoint and restored on resume.

    Attributes:
        history: every step's metrics, in order.
        wall_time_s: the training steps' time over every invocation of the run (setup apart).
        tokens_total: generated response tokens.
        rollout_time_s: of the wall time, the rollout phase's (generation, reward, advantages, log-prob scoring).
        setup_time_s: this invocation's setup time (not saved: a resumed run measures its own).
        evaluations: every held-out evaluation's figures, with its ``step`` (0: before training).
    """

    history: list[dict[str, float]] = field(default_factory=list)
    wall_time_s: float = 0.0
    tokens_total: int = 0
    rollout_time_s: float = 0.0
    setup_time_s: float = 0.0
    evaluations: list[dict[str, float]] = field(default_factory=list)

    _SAVED = ("history", "wall_time_s", "tokens_total", "rollout_time_s", "evaluations")

    def add_step(self, metrics: dict[str, float], *, tokens: int) -> None:
        """Records one step's metrics (with its ``perf/step_time_s`` and ``perf/rollout_time_s``) and tokens."""
        self.history.append(metrics)
        self.wall_time_s += metrics["perf/step_time_s"]
        self.rollout_time_s += metrics["perf/rollout_time_s"]
        self.tokens_total += tokens

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._SAVED}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in self._SAVED:
            setattr(self, name, state.get(name, []) if name == "evaluations" else state[name])


def checkpoint_root(cfg: GRPORecipeConfig | DictConfig) -> Path:
    """Where a GRPO run keeps its checkpoints: ``<output_dir>/checkpoints`` (of the typed settings, or of a composed
    config: a resume finds its checkpoints before the settings are checked)."""
    return Path(cfg.output_dir) / "checkpoints"


def checkpoint_policy_node(cfg: GRPORecipeConfig, checkpoint: Path) -> ModelNode:
    """The model node of the policy a checkpoint saved (weights and tokenizer in its model folder)."""
    return dataclasses.replace(cfg.model, name_or_path=str(checkpoint / MODEL_FOLDER), tokenizer_name_or_path=None)


def save_merged_model_folder(model, tokenizer, folder) -> None:
    """A LoRA model (``peft.PeftModel``) saved as one full ``transformers`` model, its adapters merged in: loadable
    without peft, computing what the adapted model does (``recipes.common.models.merge_adapters``). The merge runs on
    a copy (the model's own base weights stay untouched, bit for bit), which costs a second copy of the model in
    memory while it saves."""
    save_model_folder(merge_adapters(copy.deepcopy(model)), tokenizer, folder)


def capture_rng_state() -> dict[str, Any]:
    """Python's and torch's RNG states (CUDA too when present), in a weights-only-loadable form."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Puts back what :func:`capture_rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep_last: int | None = None,
    model_state_dict: dict[str, torch.Tensor] | None = None,
    optimizer_state_dict: dict[str, Any] | None = None,
    save_merged: bool = False,
    reference: tuple | None = None,
) -> Path:
    """Writes ``<root>/step_<step>`` atomically, then deletes all but the ``keep_last`` newest checkpoints.

    Args:
        root: the folder holding the run's checkpoints.
        step: the number of optimizer steps done.

    Keyword Args:
        model: a ``transformers`` model (``save_pretrained``).
        tokenizer: its tokenizer, saved beside it.
        optimizer: its state is saved.
        state: extra training state (numbers, strings, tensors, lists, dicts; the caller's RNG states among them,
            e.g. every rank's :func:`capture_rng_state`); ``step`` is added.
        keep_last: how many checkpoints to keep; ``None`` keeps all.
        model_state_dict: the weights to save instead of ``model``'s own (those of a sharded model, gathered:
            ``recipes.common.sharding.gather_full_state``).
        optimizer_state_dict: the optimizer state to save instead of ``optimizer.state_dict()`` (likewise).
        save_merged: a LoRA model's merged full model too, in ``merged_model/``.
        reference: ``(model, state_dict or None)``: a reference model that moves with the policy
            (``loss.sync_ref_model``), saved in ``reference_model/``.
    """

    if save_merged and model_state_dict is not None:
        raise ValueError(
            "save_checkpoint: save_merged=True merges the adapters of the model itself, but model_state_dict is "
            "given (a sharded model's gathered weights): save the adapter only, and merge it after loading."
        )

    def write(folder: Path) -> None:
        save_model_folder(model, tokenizer, folder / MODEL_FOLDER, state_dict=model_state_dict)
        if save_merged:
            save_merged_model_folder(model, tokenizer, folder / MERGED_MODEL_FOLDER)
        if reference is not None:
            save_model_folder(reference[0], tokenizer, folder / REFERENCE_FOLDER, state_dict=reference[1])
        optimizer_state = optimizer_state_dict if optimizer_state_dict is not None else optimizer.state_dict()
        payload = {**state, "step": step, "optimizer": optimizer_state}
        torch.save(payload, folder / STATE_FILE)
        write_manifest(folder)  # last: what a resume checks the folder against

    destination = checkpoint_folder(root, step)
    try:
        folder = write_folder_atomically(write, destination)
    except (OSError, RuntimeError) as error:
        if not _out_of_space(error):
            raise
        previous = latest_checkpoint(root)
        kept = f"the previous checkpoint, {previous}, is intact" if previous else "no earlier checkpoint exists"
        raise RunStopped(
            f"No space left on {Path(root).resolve()} while saving the checkpoint of step {step} (its unfinished "
            f"folder was removed; {kept}). Free space there (or set checkpoint.keep_last lower), then resume=true."
        ) from None
    if keep_last is not None:
        prune_checkpoints(root, keep_last=keep_last)
    return folder


def _out_of_space(error: BaseException) -> bool:
    """A write that failed for want of disk space: ``ENOSPC``, or torch's zip writer's own words for it."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    text = str(error)
    return "unexpected pos" in text or "No space left" in text


def prune_checkpoints(root: str | Path, *, keep_last: int) -> None:
    """Deletes all but the ``keep_last`` newest checkpoints under ``root``, never the newest one whose files match
    its manifest: a damaged newer checkpoint cannot cost the last good one."""
    checkpoints = list_checkpoints(root)
    verified = next((folder for _, folder in reversed(checkpoints) if not check_manifest(folder)), None)
    for _, old in checkpoints[:-keep_last]:
        if old != verified:
            shutil.rmtree(old, ignore_errors=True)


def load_training_state(folder: str | Path, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The ``training_state.pt`` of a checkpoint folder, loaded with ``weights_only=True``.

    A missing or unreadable file is refused with a :class:`ConfigError` naming it and the checkpoint to fall back to.
    """
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise ConfigError(f"The checkpoint {folder} has no {STATE_FILE}. {broken_checkpoint_advice(folder)}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises RuntimeError, UnpicklingError or EOFError, depending on the damage
        reason = str(error).split(". ")[0].splitlines()[0] if str(error) else "the file ends early"
        # Not chained: torch's message advises weights_only=False, which would run whatever code the file holds.
        raise ConfigError(
            f"{path} cannot be loaded ({type(error).__name__}: {reason}): it is corrupted or truncated (a disk that "
            f"filled up, a copy cut short), or no training state this recipe wrote. {broken_checkpoint_advice(folder)}"
        ) from None


def resume_changes(cfg: DictConfig) -> dict:
    """The settings of ``cfg`` that differ from the run being continued (its ``resolved_config.yaml``), as
    ``{"a.b": (old, new)}``, leaving out those a resumed run may change freely (:data:`RESUME_FREE_KEYS`)."""
    return common_resume_changes(cfg, free_keys=RESUME_FREE_KEYS)


def finished_run_summary(cfg: GRPORecipeConfig) -> dict | None:
    """With ``resume=true`` in a run that already reached ``train.steps``: its ``summary.json``; else None."""
    checkpoints = list_checkpoints(checkpoint_root(cfg)) if cfg.resume else []
    summary = Path(cfg.output_dir) / "summary.json"
    if checkpoints and checkpoints[-1][0] >= cfg.train.steps and summary.is_file():
        return json.loads(summary.read_text())
    return None


def resumed_config(cfg: DictConfig) -> DictConfig:
    """The config a resumed run trains with (``recipes.common.resume.resumed_config``): the run's own
    ``resolved_config.yaml`` under this command line, in this folder.

    Raises:
        ConfigError: the folder holds checkpoints but no ``resolved_config.yaml`` (no run of this recipe to continue).
    """
    return common_resumed_config(cfg, has_checkpoint=bool(list_checkpoints(checkpoint_root(cfg))))
