"""What a trl-rollouts run reports: trl's logs under the recipes' names, the recipe's own figures, ``summary.json``.

- :func:`metric_name`: a trl log key as the recipes name it (``reward`` -> ``rollout/reward_mean``...).
- :class:`MetricsCallback`: trl's logs, renamed, with the recipe's figures of the batches they cover (the oracle's
  mean, distinct-2), to the run's logger; those figures are also kept in trl's log history, which every checkpoint
  saves, so that a resumed run's summary covers the whole run.
- :class:`StepBar`: transformers' bar of the optimizer steps (``progress_bar=true``), without its print of every log.
- :func:`summary_keys`: every entry ``summary.json`` will hold for a config, known before anything loads (``metric``
  is checked against it); :func:`summarize` writes them; :func:`closing_message` is the run's last line.

Dependencies: torch, transformers (``TrainerCallback``), the recipes' own modules.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from transformers import ProgressCallback, TrainerCallback

from recipes.common.metrics import (
    MetricLogger,
    barely_learned_line,
    held_out_accuracy,
    peak_device_memory,
    sampler_mismatch_line,
    sampler_mismatch_summary,
)
from recipes.common.text_metrics import distinct_bigrams
from recipes.common.tools import tool_entries
from recipes.trl_grpo.evaluation import EVAL_KEYS, eval_series, format_dialog
from recipes.trl_grpo.rollout_store import ROLLOUTS_DIR
from recipes.trl_grpo.schema import TrlGRPORecipeConfig

__all__ = [
    "MetricsCallback",
    "StepBar",
    "closing_message",
    "logged_series",
    "metric_name",
    "reward_source_names",
    "summarize",
    "summary_keys",
]

log = logging.getLogger(__name__)

# trl's log keys that describe the sampled batch (the rest describe the update).
_ROLLOUT_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "num_tokens")
# trl's keys for what the GRPO recipe logs under its own names.
_GRPO_NAMES = {
    "reward": "rollout/reward_mean",
    "completions/mean_length": "rollout/response_length",
    "completions/clipped_ratio": "rollout/frac_truncated",
    "frac_reward_zero_std": "rollout/frac_reward_zero_std",
    "kl": "train/kl_to_ref",
}
# What trl 1.16's GRPOTrainer logs about every sampled batch (per reward source too: rewards/<name>/mean and /std).
_TRL_ROLLOUT_LOGS = (
    *_ROLLOUT_KEYS,
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)
# The update's figures the summary reports (train/kl_to_ref only where trl's beta is not 0: trl logs no KL then).
_SUMMARY_UPDATE = ("train/loss", "train/entropy")
# What a run with tools logs of each batch (interop.TorchRLRolloutFunc; trl logs no tools/* for a rollout_func).
TOOL_METRICS = ("rollout/tool_calls_per_dialog", "rollout/tool_errors", "rollout/turns")
# Single figures of the whole run.
_SUMMARY_TOTALS = (
    "train/steps",
    "rollouts/rows",
    "rollouts/rows_dropped",
    "rollout/generated_tokens",
    "perf/train_s",
    "perf/steps_per_s",
    "perf/tokens_per_s",
    "perf/wall_time_s",
)


def metric_name(trl_key: str) -> str:
    """A trl log key as the recipes name it: the GRPO recipe's name where it logs the same figure (``reward`` ->
    ``rollout/reward_mean``, ``completions/mean_length`` -> ``rollout/response_length``, ``kl`` ->
    ``train/kl_to_ref``...), else ``rollout/<key>`` for what describes the sampled batch (``rewards/<n>/mean``,
    ``completions/...``) and ``train/<key>`` for the update (``loss``, ``grad_norm``). The recipe's own figures
    (``rollout/oracle_mean``...) keep their names.

    Examples:
        >>> metric_name("reward"), metric_name("rewards/length/mean"), metric_name("rollout/oracle_mean")
        ('rollout/reward_mean', 'rollout/rewards/length/mean', 'rollout/oracle_mean')
    """
    if trl_key in _GRPO_NAMES:
        return _GRPO_NAMES[trl_key]
    if trl_key.startswith(("rollout/", "train/", "sampling/")):  # sampling/*: the mismatch, as the GRPO recipe's
        return trl_key
    if trl_key in _ROLLOUT_KEYS or trl_key.startswith(("rewards/", "completions/")):
        return f"rollout/{trl_key}"
    return f"train/{trl_key}"


def _renamed(logs: dict) -> dict[str, float]:
    """A training log's numbers under the recipes' names (its ``step`` apart)."""
    return {
        metric_name(key): value
        for key, value in logs.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def logged_series(log_history: list[dict]) -> dict[str, list[float]]:
    """Every training log of trl's log history (``trainer.state.log_history``: a resumed run's holds the checkpoint's
    logs before its own), renamed: name -> [value per log, in order]."""
    series: dict[str, list[float]] = {}
    for entry in log_history:
        if "loss" in entry:
            for name, value in _renamed(entry).items():
                series.setdefault(name, []).append(value)
    return series


class MetricsCallback(TrainerCallback):
    """trl's training logs, renamed (:func:`metric_name`), with the recipe's figures of the batches they cover (the
    oracle's mean over every process's completions, distinct-2), to the run's logger and into trl's log history
    (which each checkpoint saves); a progress line every ``every`` steps.

    Args:
        logger: the run's metric logger.
        trainer: the ``interop.TorchRLGRPOTrainer`` (its ``last_scored`` rows and ``rollout_func.last_rollout``).
        oracle: ``text -> float``, the data's ground truth, or ``None``.
    """

    def __init__(self, logger: MetricLogger, trainer, oracle, *, total_steps: int, every: int) -> None:
        self.logger, self.trainer, self.oracle = logger, trainer, oracle
        self.total_steps, self.every = total_steps, every
        self.trainer_figures: dict[int, dict[str, float]] = {}  # step -> the figures of the batch it trained first
        self._batches_seen = 0
        self._warned_dropped = False

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.scored_batches != self._batches_seen:  # a new generation batch trained in this step
            self._batches_seen = self.trainer.scored_batches
            self.trainer_figures[state.global_step] = self._batch_figures()

    def _batch_figures(self) -> dict[str, float]:
        rollout = self.trainer.rollout_func.last_rollout
        mask = torch.arange(rollout.get("completion_ids").shape[-1]) < rollout.get("completion_length")[:, None]
        figures = {"rollout/distinct_2": distinct_bigrams(rollout.get("completion_ids"), mask)}
        if self.oracle is not None:
            texts = self.trainer.last_scored.get("completion_text")
            scores = [float(self.oracle(text)) for text in (texts.tolist() if hasattr(texts, "tolist") else texts)]
            figures["rollout/oracle_mean"] = self._pooled_mean(sum(scores), len(scores))
        if "env_mask" in rollout.keys():
            figures.update(self._dialog_figures(rollout, mask))
        return figures

    def _pooled_mean(self, total: float, count: int) -> float:
        """``total / count`` over every process's batch."""
        device = self.trainer.accelerator.device
        totals = self.trainer.accelerator.gather(torch.tensor([[float(total), float(count)]], device=device)).sum(0)
        return float(totals[0] / totals[1])

    def _dialog_figures(self, rollout, mask: torch.Tensor) -> dict[str, float]:
        """Tools: ``rollout/frac_truncated`` counts the dialogs the completion budget cut (a turn, or a tool result
        that did not fit) as the sampler records them; trl's own ratio counts only completions without a final EOS,
        and a dialog whose tool result was left out ends on the call turn's EOS. ``rollout/frac_results_dropped``:
        the dialogs that called a tool and got no result back. Warns once when no calling dialog got one."""
        dialogs = rollout.shape[0]
        called = rollout.get("tool_calls") > 0
        answered = ((rollout.get("env_mask") == 0) & mask).any(-1)
        dropped = int((called & ~answered).sum())
        figures = {
            "rollout/frac_truncated": self._pooled_mean(int(rollout.get("truncated").sum()), dialogs),
            "rollout/frac_results_dropped": self._pooled_mean(dropped, dialogs),
        }
        if not self._warned_dropped and int(called.sum()) and not int((called & answered).sum()):
            self._warned_dropped = True
            log.warning(
                "%d of %d dialogs called a tool and none got its result back: the tool message did not fit in "
                "rollout.generation.max_new_tokens=%d, the whole dialog's budget (the call, the result and the "
                "answer), so no dialog can use a tool. Raise rollout.generation.max_new_tokens (experiment=calculator "
                "uses 64).",
                int(called.sum()),
                dialogs,
                self.trainer.args.max_completion_length,
            )
        return figures

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs:
            return
        metrics = _renamed(logs)
        covered = [step for step in self.trainer_figures if step <= state.global_step]
        figures = {}
        for name in {name for step in covered for name in self.trainer_figures[step]}:
            values = [self.trainer_figures[step][name] for step in covered if name in self.trainer_figures[step]]
            figures[name] = sum(values) / len(values)
        for step in covered:
            del self.trainer_figures[step]
        metrics.update(figures)
        # trl appended this log to its history just before calling back: the recipe's figures join it there, and
        # with it every checkpoint's trainer_state.json, which a resumed run's summary reads.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)
        # Async: the lag of every batch logged so far (a resumed run's history included), before the step commits.
        lags = [entry["policy_lag"] for entry in state.log_history if "policy_lag" in entry and "loss" in entry]
        self.logger.log_histogram("train/policy_lag_histogram", lags, step=state.global_step)
        self.logger.log(metrics, step=state.global_step)
        if args.process_index == 0 and (state.global_step % self.every == 0 or state.global_step == self.total_steps):
            shown = [
                ("reward", "rollout/reward_mean"),
                ("oracle", "rollout/oracle_mean"),
                ("tool calls", "rollout/tool_calls_per_dialog"),
                ("loss", "train/loss"),
            ]
            log.info(
                "Step %d/%d: %s",
                state.global_step,
                self.total_steps,
                ", ".join(f"{label} {metrics[key]:.3f}" for label, key in shown if key in metrics),
            )
            self._show_dialog()

    def _show_dialog(self) -> None:
        """A sampled dialog of the last batch, its tool messages marked (runs with tools)."""
        rollout = self.trainer.rollout_func.last_rollout
        if rollout is None or "env_mask" not in rollout.keys():
            return
        length = int(rollout.get("completion_length")[0])
        ids = rollout.get("completion_ids")[0, :length].tolist()
        env_mask = rollout.get("env_mask")[0, :length].tolist()
        log.info("A dialog: %r", format_dialog(self.trainer.rollout_func.tokenizer, ids, env_mask))


class StepBar(ProgressCallback):
    """transformers' tqdm bar of the optimizer steps (trl's ``disable_tqdm=False``: ``progress_bar=true``), as the GRPO
    recipe's bar, without the dict of every figure (about 1 KB of trl's) that it writes under the bar at each logging
    step: the recipe's progress lines and metrics.csv report them."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return None


def reward_source_names(cfg: TrlGRPORecipeConfig) -> list[str]:
    """The reward sources as trl names them (``rewards/<name>/mean``) and the store's ``rewards`` column orders them:
    the reward model (the last part of its ``name_or_path``; the recipe names the loaded model so) first, then each
    ``reward.functions`` entry under its config name."""
    model = [str(cfg.reward_model.name_or_path).rstrip("/").split("/")[-1]] if cfg.reward_model is not None else []
    return model + [str(name) for name in cfg.reward.functions]


def summary_keys(cfg: TrlGRPORecipeConfig, args) -> set[str]:
    """Every entry of the ``summary.json`` a run of ``cfg`` writes (``args``: ``train:`` as trl reads it): the first
    and last value of each rollout figure (trl's, under the recipes' names, per reward source too; distinct-2; the
    oracle's mean where the data has an oracle) and of the loss, entropy and (with ``beta`` > 0) KL, and the run's
    totals (steps, stored rows, tokens, times; peak CUDA memory on a GPU)."""
    series = [metric_name(key) for key in _TRL_ROLLOUT_LOGS]
    series += [f"rollout/rewards/{name}/{figure}" for name in reward_source_names(cfg) for figure in ("mean", "std")]
    series += ["rollout/distinct_2", *(["rollout/oracle_mean"] if cfg.data.oracle is not None else [])]
    series += [*_SUMMARY_UPDATE, *(["train/kl_to_ref"] if args.beta != 0 else [])]
    if tool_entries(cfg.tools):
        series += [*TOOL_METRICS, *(["eval/tool_calls_per_dialog", "eval/turns"] if cfg.eval.every_n_steps else [])]
    if cfg.eval.every_n_steps is not None:
        series += list(EVAL_KEYS)
    keys = {f"{name}_{end}" for name in series for end in ("first", "last")} | set(_SUMMARY_TOTALS)
    if str(cfg.device).startswith("cuda"):
        keys.add("perf/peak_cuda_memory_gib")
    return keys


def summarize(trainer, totals: dict[str, int], *, steps_trained: int, tokens: int, train_s: float, wall_s: float):
    """First and last of every logged rollout figure and of the loss, over the whole run (trl's log history: a
    resumed run's first figures are the first part's); what the store holds (``totals``: every part of every
    process, ``recipes.trl_grpo.rollout_store.stored_totals``); the speed of this invocation (``steps_trained``
    steps and ``tokens`` completion tokens, every process's, in ``train_s`` seconds) and its wall time."""
    summary = {}
    for name, values in sorted(logged_series(trainer.state.log_history).items()):
        if name.startswith("rollout/") or name in (*_SUMMARY_UPDATE, "train/kl_to_ref"):
            summary[f"{name}_first"], summary[f"{name}_last"] = values[0], values[-1]
    for name, values in sorted(eval_series(trainer.state.log_history).items()):
        summary[f"{name}_first"], summary[f"{name}_last"] = values[0], values[-1]
    summary.update(sampler_mismatch_summary(logged_series(trainer.state.log_history)))
    summary.update(
        {
            "train/steps": trainer.state.global_step,
            "rollouts/rows": totals["rows"],
            "rollouts/rows_dropped": totals["rows_dropped"],
            "rollout/generated_tokens": totals["tokens"],
            "perf/train_s": train_s,
            "perf/steps_per_s": steps_trained / train_s if train_s else math.nan,
            "perf/tokens_per_s": tokens / train_s if train_s else math.nan,
            "perf/wall_time_s": wall_s,
            **peak_device_memory(trainer.args.device),
        }
    )
    return summary


def closing_message(summary: dict, output_dir: Path) -> str:
    """The run's last line: its steps and reward (and oracle) from first to last, where the model and the rollouts
    are (how many the store holds, every part and process), and how to read them."""
    oracle = (
        f", oracle {summary['rollout/oracle_mean_first']:.3f} -> {summary['rollout/oracle_mean_last']:.3f}"
        if "rollout/oracle_mean_last" in summary
        else ""
    )
    first, last = summary.get("rollout/reward_mean_first", math.nan), summary.get("rollout/reward_mean_last", math.nan)
    dropped = summary["rollouts/rows_dropped"]
    kept = f" (the {dropped} oldest dropped: rollout.store.max_rows)" if dropped else ""
    return (
        f"trl GRPO with TorchRL rollouts: {summary['train/steps']} steps, reward {first:.3f} -> {last:.3f}{oracle}"
        f"{held_out_accuracy(summary)}; "
        f"model in {output_dir / 'model'}, {summary['rollouts/rows']} rollouts in {output_dir / ROLLOUTS_DIR}{kept} "
        f"(recipes.trl_grpo.rollout_store.load_rollouts reads them).{sampler_mismatch_line(summary)}"
        f"{barely_learned_line(summary)}"
    )
