"""Held-out evaluation of a trl-rollouts run (``eval:``): the data's eval prompts answered by the policy trl trains,
scored by one reward function, as ``eval/accuracy``.

trl's own evaluation (``eval_strategy``) would run the eval prompts through the ``rollout_func`` and the rollout store
as if they were training batches; this callback samples them beside trl instead, with the rollout function's sampler
(the same settings, tools and turn limit as training: what a user of the trained policy gets), before the first step,
every ``eval.every_n_steps`` steps and at the last step. The draws come from a generator of their own (the run's seed),
so an evaluation leaves the training's random stream as it was and every evaluation answers with the same draws.

- :class:`EvalCallback`: the callback; its figures go to the run's logger and into trl's log history (which each
  checkpoint saves, so a resumed run's summary has the first evaluation's figures).
- :func:`format_dialog`: a completion's text with its tool messages marked ``[tool]...[/tool]``.

Dependencies: torch, transformers (``TrainerCallback``), the recipes' own modules.
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback

from recipes.common.config import RunStopped

__all__ = ["EVAL_KEYS", "EvalCallback", "eval_series", "format_dialog"]

log = logging.getLogger(__name__)

# What an evaluation logs (and summary.json reports first and last of).
EVAL_KEYS = ("eval/accuracy",)
_TOOL_KEYS = ("eval/tool_calls_per_dialog", "eval/turns")


def format_dialog(tokenizer, completion_ids: list[int], env_mask: list[int] | None) -> str:
    """The completion decoded without special tokens, each run of tool-message tokens (``env_mask`` 0) wrapped in
    ``[tool]...[/tool]`` so that a reader tells the tool's words from the policy's.

    Examples:
        >>> class Characters:
        ...     def decode(self, ids, skip_special_tokens=True):
        ...         return "".join(map(chr, ids))
        >>> format_dialog(Characters(), [104, 52, 50, 33], [1, 0, 0, 1])
        'h[tool]42[/tool]!'
    """
    if env_mask is None:
        return tokenizer.decode(completion_ids, skip_special_tokens=True)
    pieces: list[tuple[list[int], int]] = []
    for token, mine in zip(completion_ids, env_mask, strict=True):
        if pieces and pieces[-1][1] == mine:
            pieces[-1][0].append(token)
        else:
            pieces.append(([token], mine))
    text = ""
    for ids, mine in pieces:
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        text += decoded if mine else f"[tool]{decoded}[/tool]"
    return text


class EvalCallback(TrainerCallback):
    """Answers the eval prompts with the rollout function's sampler and logs the named reward function's mean.

    Args:
        trainer: the ``interop.TorchRLGRPOTrainer`` (its ``rollout_func`` and accelerator).
        logger: the run's metric logger.
        table: the eval prompts (``recipes.common.prompts.PromptTable``: conversations and their columns).
        reward_function: the reward source scored (trl's form), whose values must be 0 or 1.

    Keyword Args:
        name: that source's name (``eval.accuracy_source``), for messages.
        every: evaluate every this many steps (and before the first, and at the last).
        total_steps: the run's ``train.max_steps``.
        seed: the evaluations' draws.
    """

    def __init__(self, trainer, logger, table, reward_function, *, name: str, every: int, total_steps: int, seed: int):
        self.trainer, self.logger, self.table, self.reward_function = trainer, logger, table, reward_function
        self.name, self.every, self.total_steps, self.seed = name, every, total_steps, seed

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:  # a resumed run evaluated its start in the part before
            self._evaluate(state)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == self.total_steps:
            self._evaluate(state)

    def _evaluate(self, state) -> None:
        trainer, rollout_func = self.trainer, self.trainer.rollout_func
        rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
        rows = list(range(rank, len(self.table), world))  # each process answers its share
        prompts = [self.table.conversations[row] for row in rows]
        kept_dialogs = getattr(rollout_func, "last_dialogs", None)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            rollout = rollout_func.rollout(prompts, trainer=trainer)
        rollout_func.last_dialogs = kept_dialogs  # the training batch's, which the run's samples show
        lengths = rollout.get("completion_length").tolist()
        ids = [row[:n] for row, n in zip(rollout.get("completion_ids").tolist(), lengths, strict=True)]
        texts = rollout_func.tokenizer.batch_decode(ids, skip_special_tokens=True)
        columns = {name: [values[row] for row in rows] for name, values in self.table.columns.items()}
        scores = self.reward_function(
            prompts=prompts,
            completions=[[{"role": "assistant", "content": text}] for text in texts],  # as trl decodes them
            completion_ids=ids,
            **columns,
        )
        if any(score not in (0, 1) for score in scores):
            raise RunStopped(
                f"eval.accuracy_source={self.name}: it scored the eval answers with values other than 0 and 1 "
                f"({sorted({float(s) for s in scores if s not in (0, 1)})[:5]}), so its mean is no accuracy. Name a "
                "0/1 check."
            )
        totals = [sum(map(float, scores)), float(len(scores))]
        if "tool_calls" in rollout.keys():
            totals += [float(rollout.get("tool_calls").sum()), float(rollout.get("turns").sum())]
        device = trainer.accelerator.device
        totals = trainer.accelerator.gather(torch.tensor([totals], device=device)).sum(0).tolist()
        figures = {"eval/accuracy": totals[0] / totals[1]}
        if len(totals) > 2:
            figures.update(dict(zip(_TOOL_KEYS, (totals[2] / totals[1], totals[3] / totals[1]), strict=True)))
        state.log_history.append({**figures, "step": state.global_step})
        self.logger.log(figures, step=state.global_step)
        if trainer.accelerator.is_main_process:
            env_mask = rollout.get("env_mask").tolist()[0][: lengths[0]] if "env_mask" in rollout.keys() else None
            sample = format_dialog(rollout_func.tokenizer, ids[0], env_mask) if ids else ""
            log.info(
                "Eval at step %d: accuracy %.3f on %d prompts; a dialog: %r",
                state.global_step,
                figures["eval/accuracy"],
                int(totals[1]),
                sample,
            )


def eval_series(log_history: list[dict]) -> dict[str, list[float]]:
    """Every evaluation's figures in trl's log history, in order: name -> values."""
    series: dict[str, list[float]] = {}
    for entry in log_history:
        if "eval/accuracy" in entry:
            for name, value in entry.items():
                if name.startswith("eval/"):
                    series.setdefault(name, []).append(value)
    return series
