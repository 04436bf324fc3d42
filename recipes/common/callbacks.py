"""transformers ``TrainerCallback`` s that both trl-based recipes use (``RewardTrainer``, ``GRPOTrainer``).

- :func:`make_finite_guard`: stops training at the first non-finite gradient or logged loss, saying where.
- :func:`make_record_masker`: keeps secrets out of the trainer config each checkpoint pickles (``training_args.bin``).

Dependencies: torch, transformers.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import torch
from transformers import TrainerCallback

__all__ = ["make_finite_guard", "make_record_masker"]


def make_finite_guard():
    """A TrainerCallback that stops training at the first non-finite gradient or logged loss (every process runs
    it: DDP's gradients are the same everywhere, so all stop together); ``reason`` says what and when, and the
    recipe then saves nothing and fails naming it."""

    class StopOnNonFinite(TrainerCallback):
        reason: str | None = None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads = [p.grad for p in model.parameters() if p.grad is not None] if model is not None else []
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            if local and not all(bool(torch.isfinite(g).all()) for g in local):
                self._stop(control, f"a non-finite gradient at step {state.global_step + 1}")

        def on_log(self, args, state, control, logs=None, **kwargs):
            for key in ("loss", "grad_norm", "eval_loss"):
                value = (logs or {}).get(key)
                if isinstance(value, float) and not math.isfinite(value):
                    self._stop(control, f"{key} = {value} at step {state.global_step}")

        def _stop(self, control, reason: str) -> None:
            self.reason = self.reason or reason
            control.should_training_stop = True

    return StopOnNonFinite()


def make_record_masker(masked: dict[str, str]):
    """A TrainerCallback that rewrites each checkpoint's ``training_args.bin`` (transformers pickles its whole config
    there) with the fields of ``masked`` replaced by their record (``field -> "${oc.env:NAME}"`` or ``"<FIELD>"``):
    the trainer itself keeps and uses the real values; the run folder never holds them in clear."""

    class MaskTrainingArgs(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / "training_args.bin"
            if not masked or not state.is_world_process_zero or not path.is_file():
                return
            record = copy.copy(args)
            for field, shown in masked.items():
                setattr(record, field, shown)
            partial = path.with_name(path.name + ".partial")
            torch.save(record, partial)
            os.replace(partial, path)

    return MaskTrainingArgs()
