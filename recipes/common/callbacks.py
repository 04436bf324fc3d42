"""transformers ``TrainerCallback`` s that both trl-based recipes use (``RewardTrainer``, ``GRPOTrainer``).

- :func:`make_finite_guard`: stops training at the first non-finite gradient or logged loss, saying where.

Dependencies: torch, transformers.
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

__all__ = ["make_finite_guard"]


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
