"""What a GRPO run says about itself: each step's figures, the progress line and sample rollouts in its log, what
the run is at its start, and ``summary.json`` with the closing message at its end.

- :func:`rollout_metrics`: a step's reward, oracle and length statistics (pooled over the processes);
  :func:`logged_metrics`: what its trl reward functions logged (``log_metric``), as trl reports it.
- :func:`report_step`: the step's metrics to the logger, a progress line, sample rollouts (:func:`sample_rollouts`).
- :func:`run_description`, :func:`closing_message`: the first and last lines of the run's log.
- :func:`summarize`: ``summary.json`` (:data:`SUMMARY_KEYS`: what ``metric=`` may name).

Dependencies: torch, omegaconf, and the recipe's own modules.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from accelerate.utils import gather_object

from recipes.common.metrics import (
    barely_learned_line,
    held_out_accuracy,
    sampler_mismatch_line,
    sampler_mismatch_summary,
)
from recipes.common.run import Run
from recipes.common.text_metrics import distinct_bigrams
from recipes.common.tools import tool_entries
from recipes.grpo.batch import (
    ADVANTAGE,
    DIALOG_TOOL_CALLS,
    DIALOG_TOOL_ERRORS,
    DIALOG_TURNS,
    PROMPT_INDEX,
    RESPONSE_TOKENS,
    REWARD,
    SOURCE_REWARDS,
    TRUNCATED,
    policy_token_mask,
    response_mask,
    response_texts,
)
from recipes.grpo.checkpointing import TrainingProgress
from recipes.grpo.evaluation import accuracy_source
from recipes.grpo.rewards import logged_in_batch, reward_sources
from recipes.grpo.schema import GRPORecipeConfig

__all__ = [
    "RUN_FIGURES",
    "SUMMARY_KEYS",
    "SUMMARY_SERIES",
    "TOOL_SERIES",
    "closing_message",
    "is_source_figure",
    "logged_metrics",
    "progress_line",
    "report_step",
    "rollout_metrics",
    "run_description",
    "sample_rollouts",
    "summarize",
    "summary_keys",
    "summary_series",
]

log = logging.getLogger(__name__)

# summary.json: the run's figures, then the first and last value (last: averaged over summary.window steps) of each
# series; SUMMARY_KEYS is the one list of them (what main() may return as cfg.metric).
RUN_FIGURES = (
    "train/steps",
    "train/num_processes",
    "rollout/generated_tokens",
    "perf/wall_time_s",
    "perf/tokens_per_s",
    "perf/setup_time_s",
)
SUMMARY_SERIES = ("rollout/reward_mean", "rollout/oracle_mean", "rollout/distinct_2", "train/kl_to_ref")
SUMMARY_KEYS = (*RUN_FIGURES, *(f"{name}_{end}" for name in SUMMARY_SERIES for end in ("first", "last")))
# A tool-calling run's dialogs (tools: set): tool calls and assistant turns per dialog, and the step's failed calls
# (raised, timed out, malformed, unknown tool, arguments refused: each answered to the model with trl's error text).
TOOL_SERIES = ("rollout/tool_calls_per_dialog", "rollout/tool_errors", "rollout/turns")


def _nanstd(values: torch.Tensor) -> torch.Tensor:
    """The unbiased standard deviation of the non-NaN values (NaN when fewer than two), as trl's ``nanstd``."""
    kept = values[~torch.isnan(values)]
    return kept.std() if kept.numel() > 1 else torch.tensor(float("nan"))


def rollout_metrics(
    data, tokenizer, oracle, *, group_size: int, gather=None, source_names=()
) -> tuple[dict[str, float], int]:
    """Reward, oracle and length statistics of one step's responses, and how many tokens the policy generated (a
    dialog's tool messages not counted; ``rollout/response_length`` counts the whole completion, as trl's completion
    length).

    ``rollout/frac_reward_zero_std`` is the fraction of groups (each prompt's ``group_size`` contiguous responses)
    whose rewards are all equal: they teach nothing, their advantages are 0. ``gather`` (``pool_over_processes``)
    pools the per-response values of every data-parallel rank first, so that the figures are those of the whole
    step's responses. ``source_names`` (``recipes.grpo.rewards.reward_sources``' names, in order) adds each reward
    source's ``rollout/rewards/<name>/mean`` and ``/std`` over the responses it applies to (trl's
    ``rewards/<name>/mean``)."""
    mask = response_mask(data)
    values = {
        "reward": data.get(REWARD).reshape(-1).float(),
        "length": mask.sum(-1).double(),
        # What the policy sampled: a dialog's tool messages were written by the tools, not generated.
        "generated": policy_token_mask(data).sum(-1).double(),
        "truncated": data.get(TRUNCATED).reshape(-1).double(),
    }
    if source_names:
        values["sources"] = data.get(SOURCE_REWARDS).reshape(len(data), -1).float()
    if oracle is not None:
        texts = response_texts(data, tokenizer)
        values["oracle"] = torch.tensor([float(oracle(t)) for t in texts], dtype=torch.float64)
    dialogs = DIALOG_TURNS in data.keys(include_nested=True)
    if dialogs:
        counts = {"turns": DIALOG_TURNS, "tool_calls": DIALOG_TOOL_CALLS, "tool_errors": DIALOG_TOOL_ERRORS}
        values.update({name: data.get(key).reshape(-1).double() for name, key in counts.items()})
    if gather is not None:
        values = {key: gather(value) for key, value in values.items()}
    metrics = {
        "rollout/reward_mean": values["reward"].mean().item(),
        "rollout/reward_std": values["reward"].std().item(),
        "rollout/frac_reward_zero_std": (values["reward"].view(-1, group_size).std(-1) == 0).float().mean().item(),
    }
    for column, name in enumerate(source_names):
        source = values["sources"][:, column]
        metrics[f"rollout/rewards/{name}/mean"] = source.nanmean().item()
        metrics[f"rollout/rewards/{name}/std"] = _nanstd(source).item()
    if oracle is not None:
        metrics["rollout/oracle_mean"] = values["oracle"].mean().item()
    metrics["rollout/response_length"] = values["length"].mean().item()
    metrics["rollout/frac_truncated"] = values["truncated"].mean().item()  # hit max_new_tokens before an EOS
    metrics["rollout/distinct_2"] = distinct_bigrams(data.get(RESPONSE_TOKENS), mask)
    if dialogs:
        metrics["rollout/tool_calls_per_dialog"] = values["tool_calls"].mean().item()
        metrics["rollout/tool_errors"] = values["tool_errors"].sum().item()  # failed calls of the step (all ranks)
        metrics["rollout/turns"] = values["turns"].mean().item()
    return metrics, int(values["generated"].sum().item())


def logged_metrics(data, *, prefix: str) -> dict[str, float]:
    """Every metric the trl reward functions logged (``log_metric(name, value)``) while ``data``'s responses were
    scored, averaged over every value logged (on every process), as trl averages them per step: ``<prefix>/<name>``
    (``rollout/`` for training batches, trl's own names beside its metrics). NaN values are left out, as trl leaves
    them out of its averages."""
    metrics, _ = logged_in_batch(data)
    totals: dict[str, list[float]] = {}
    for share in gather_object([metrics]):  # every process's, in rank order (this one's alone outside torchrun)
        for name, values in share.items():
            kept = [value for value in values if not math.isnan(value)]
            total = totals.setdefault(name, [0.0, 0])
            total[0], total[1] = total[0] + sum(kept), total[1] + len(kept)
    return {f"{prefix}/{name}": total / count if count else math.nan for name, (total, count) in sorted(totals.items())}


def is_source_figure(key: str) -> bool:
    """Whether ``key`` is one reward source's figure (``rollout/rewards/<name>/mean`` or ``/std``): NaN when the source
    scored none of the step's responses (a trl reward function that returned ``None`` for all of them), as trl logs
    it, with nothing wrong with the run.

    Examples:
        >>> is_source_figure("rollout/rewards/format/mean"), is_source_figure("rollout/reward_mean")
        (True, False)
    """
    return key.startswith("rollout/rewards/")


def report_step(
    cfg: GRPORecipeConfig, run: Run, step: int, metrics: dict, bar, *, samples, lags: list[float] = ()
) -> None:
    """The step's metrics to the logger, a progress line every ``log_every_n_steps`` steps and sample rollouts every
    ``samples.every_n_steps`` to the log (``samples(count=n)`` draws them), the live reward on the progress bar;
    ``lags``: the policy lag of every batch trained so far, a wandb histogram (``train/policy_lag_histogram``)."""
    run.logger.log_histogram("train/policy_lag_histogram", list(lags), step=step)
    every = cfg.samples.every_n_steps
    drawn = []
    if run.is_main and every is not None and (step % every == 0 or step in (1, cfg.train.steps)):
        drawn = samples(count=max(cfg.samples.log_count, cfg.samples.print_count))
        # Before the step's metrics, which commit the step in wandb: a table logged after them would be refused.
        run.logger.log_samples(drawn[: cfg.samples.log_count], step=step)
    run.logger.log(metrics, step=step)
    if run.is_main and (step % cfg.log_every_n_steps == 0 or step == cfg.train.steps):
        log.info(progress_line(step, cfg.train.steps, metrics))
    for sample in drawn[: cfg.samples.print_count]:
        log.info("Step %d sample: %s", step, json.dumps(sample, ensure_ascii=False))
    shown = {"reward": f"{metrics['rollout/reward_mean']:.3f}"}
    if "rollout/oracle_mean" in metrics:
        shown["oracle"] = f"{metrics['rollout/oracle_mean']:.3f}"
    bar.set_postfix(shown)
    bar.update(1)


def _reward_description(cfg: GRPORecipeConfig) -> str:
    """``reward model <path> (reward.input=history) x 1.0 + accuracy (reward function) x 0.5 ...``"""
    parts = []
    for source in reward_sources(cfg):
        if source.kind == "model":
            what = f"reward model {cfg.reward_model.name_or_path} (reward.input={cfg.reward.input})"
        else:
            what = f"{source.name} (reward {source.kind})"
        parts.append(what if source.weight == 1.0 else f"{what} x {source.weight:g}")
    return " + ".join(parts)


def run_description(cfg: GRPORecipeConfig, *, num_prompts: int, world_size: int) -> str:
    """What the run trains, on what, where: the first line of its log."""
    processes = f" x {world_size} processes" if world_size > 1 else ""
    tools = list(tool_entries(cfg.tools))
    tools = f", tools {tools} (up to {cfg.rollout.max_turns} turns)" if tools else ""
    return (
        f"GRPO ({cfg.rollout.env} env, {cfg.rollout.mode}): policy {cfg.model.name_or_path}, rewarded by "
        f"{_reward_description(cfg)}, data={cfg.data.source} "
        f"({num_prompts} prompts){tools}; {cfg.train.steps} steps of {cfg.rollout.responses_per_step} responses"
        f"{processes} "
        f"(groups of {cfg.rollout.group_size}, up to {cfg.rollout.generation['max_new_tokens']} new tokens), lr "
        f"{cfg.optimizer.lr}, seed {cfg.seed}, {cfg.device} {cfg.dtype}; run folder {cfg.output_dir}"
    )


def progress_line(step: int, steps: int, metrics: dict[str, float]) -> str:
    """One step's headline figures, for the log every ``log_every_n_steps`` steps; with two or more reward sources,
    each source's mean after the reward (trl's ``rewards/<name>/mean``).

    Examples:
        >>> progress_line(3, 30, {"rollout/reward_mean": 1.5, "rollout/rewards/rm/mean": 1.0,
        ...     "rollout/rewards/format/mean": 0.5, "rollout/response_length": 9.0, "perf/step_time_s": 0.2})
        'Step 3/30: reward 1.500 (rm 1.000, format 0.500), length 9.0, 0.20 s/step'
    """
    shown = [f"reward {metrics['rollout/reward_mean']:.3f}"]
    sources = {
        key.removeprefix("rollout/rewards/").removesuffix("/mean"): value
        for key, value in metrics.items()
        if key.startswith("rollout/rewards/") and key.endswith("/mean")
    }
    if len(sources) > 1:
        shown[0] += " (" + ", ".join(f"{name} {value:.3f}" for name, value in sources.items()) + ")"
    if "rollout/oracle_mean" in metrics:
        shown.append(f"oracle {metrics['rollout/oracle_mean']:.3f}")
    if "rollout/distinct_2" in metrics:
        shown.append(f"distinct-2 {metrics['rollout/distinct_2']:.2f}")
    if "train/kl_to_ref" in metrics:
        shown.append(f"KL {metrics['train/kl_to_ref']:.4f}")
    shown.append(f"length {metrics['rollout/response_length']:.1f}")
    if "rollout/tool_calls_per_dialog" in metrics:
        shown.append(f"tool calls {metrics['rollout/tool_calls_per_dialog']:.2f}/dialog")
    shown.append(f"{metrics['perf/step_time_s']:.2f} s/step")
    return f"Step {step}/{steps}: {', '.join(shown)}"


def sample_rollouts(batch, prompts, tokenizer, oracle, *, count: int, source_names=()) -> list[dict]:
    """``count`` of a step's rollouts, spread over its groups: the prompt as the data gives it, the response's text,
    its reward, each reward source's value (``None``: not applicable), the columns the trl reward functions logged
    for it (``log_extra``: trl's completions table's extra columns; ``None`` where its batch logged none), its
    advantage and, where the data has one, its oracle score."""
    if count < 1:
        return []
    rows = torch.linspace(0, batch.shape[0] - 1, count).round().long().unique().tolist()
    _, logged = logged_in_batch(batch)
    extra_columns = list(dict.fromkeys(name for row in rows for name in logged[row]))
    rewards = batch.get(REWARD).reshape(batch.shape[0], -1)[:, 0]
    sources = batch.get(SOURCE_REWARDS).reshape(batch.shape[0], -1) if source_names else None
    advantages = batch.get(ADVANTAGE).reshape(batch.shape[0], -1)[:, 0] if ADVANTAGE in batch.keys() else None
    samples = []
    texts = response_texts(batch, tokenizer, rows=rows)
    shown = response_texts(batch, tokenizer, rows=rows, mark_tools=True)  # tool messages marked [tool]...[/tool]
    for index, row in enumerate(rows):
        response = texts[index]
        prompt = prompts[int(batch.get(PROMPT_INDEX)[row])]
        if not isinstance(prompt, str):  # a conversation
            prompt = "\n".join(f"{message['role']}: {message['content']}" for message in prompt)
        sample = {"prompt": prompt, "response": shown[index], "reward": round(float(rewards[row]), 4)}
        for column, name in enumerate(source_names):
            value = float(sources[row, column])
            sample[f"rewards/{name}"] = None if math.isnan(value) else round(value, 4)
        for name in extra_columns:
            sample[_extra_column_name(name, source_names)] = logged[row].get(name)
        if advantages is not None:
            sample["advantage"] = round(float(advantages[row]), 4)
        if oracle is not None:
            sample["oracle"] = round(float(oracle(response)), 4)
        samples.append(sample)
    return samples


# What a sample row holds of its own (and "step", the wandb table's first column).
_SAMPLE_KEYS = ("step", "prompt", "response", "reward", "advantage", "oracle")


def _extra_column_name(name: str, source_names) -> str:
    """A logged column's name in a sample row: its own, or ``extra/<name>`` where the row has one of that name."""
    taken = {*_SAMPLE_KEYS, *(f"rewards/{source}" for source in source_names)}
    return f"extra/{name}" if name in taken else name


def closing_message(summary: dict, output_dir: Path) -> str:
    """Where the run is, its headline figures and what to run next."""
    oracle = ""
    if "rollout/oracle_mean_first" in summary:
        oracle = f", oracle {summary['rollout/oracle_mean_first']:.3f} -> {summary['rollout/oracle_mean_last']:.3f}"
    return (
        f"GRPO done: {summary['train/steps']} steps in {summary['perf/wall_time_s']:.1f} s "
        f"({summary['perf/tokens_per_s']:.0f} "
        f"generated tokens/s of rollout); reward {summary['rollout/reward_mean_first']:.3f} -> "
        f"{summary['rollout/reward_mean_last']:.3f}{oracle}{held_out_accuracy(summary)}. Run folder: {output_dir}. "
        f"Curves: python scripts/plot_run.py {output_dir}.{sampler_mismatch_line(summary)}"
        f"{barely_learned_line(summary)}"
    )


def summary_keys(cfg: GRPORecipeConfig) -> list[str]:
    """Every entry summary.json of a run of ``cfg`` holds (what ``metric=`` may name): :data:`SUMMARY_KEYS` and each
    reward source's mean, first and last; with evaluation on, its figures (``eval/accuracy`` where
    ``recipes.grpo.evaluation.accuracy_source`` names a source). What reward functions log (``rollout/<name>``) is
    in summary.json too, but known only once they log it: ``metric=`` cannot name it."""
    names = [source.name for source in reward_sources(cfg)]
    series = [*(TOOL_SERIES if tool_entries(cfg.tools) else ()), *(f"rollout/rewards/{name}/mean" for name in names)]
    if cfg.eval.every_n_steps is not None:
        series += ["eval/reward_mean", "eval/response_length", *(f"eval/rewards/{name}/mean" for name in names)]
        series += ["eval/oracle_mean"] if cfg.data.oracle is not None else []
        series += ["eval/accuracy"] if accuracy_source(cfg) is not None else []
    return [*SUMMARY_KEYS, *(f"{name}_{end}" for name in series for end in ("first", "last"))]


# The rollout/* figures the recipe logs itself (rollout_metrics', and dynamic sampling's): any other rollout/* key is
# one a trl reward function logged (log_metric).
_ROLLOUT_FIGURES = (
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/frac_reward_zero_std",
    "rollout/oracle_mean",
    "rollout/response_length",
    "rollout/frac_truncated",
    "rollout/distinct_2",
    "rollout/groups_filtered",
    "rollout/extra_batches",
    *TOOL_SERIES,
)


def _is_worker_figure(key: str) -> bool:
    """``rollout/workers``, ``rollout/worker_restarts``, ``rollout/worker_<i>/tokens_per_s``, ``rollout/withheld``,
    ``rollout/withheld_s``, ``rollout/resampled``: the sampling workers' (``recipes.grpo.collector_workers``), in
    metrics.csv but no summary series."""
    figures = ("rollout/workers", "rollout/withheld", "rollout/withheld_s", "rollout/resampled")
    return key in figures or key.startswith("rollout/worker_")


def summary_series(history: list[dict]) -> list[str]:
    """The training series summary.json gives ``_first``/``_last`` of: :data:`SUMMARY_SERIES`, a tool-calling run's
    :data:`TOOL_SERIES`, then each reward
    source's mean (``rollout/rewards/<name>/mean``) that the run logged, then what the trl reward functions logged
    (``rollout/<name>``)."""
    logged = dict.fromkeys(key for row in history for key in row)
    per_source = [key for key in logged if key.startswith("rollout/rewards/") and key.endswith("/mean")]
    by_functions = [
        key
        for key in logged
        if key.startswith("rollout/")
        and key not in _ROLLOUT_FIGURES
        and not key.startswith("rollout/rewards/")
        and not _is_worker_figure(key)
    ]
    tools = [key for key in TOOL_SERIES if key in logged]
    return [*SUMMARY_SERIES, *tools, *per_source, *by_functions]


def summarize(progress: TrainingProgress, *, window: int, num_processes: int) -> dict:
    """The run's :data:`SUMMARY_KEYS`. ``perf/wall_time_s``: the training steps' time over every invocation (setup
    apart); ``perf/tokens_per_s``: generated tokens per second of rollout (generation, reward, log-prob scoring)."""
    history = progress.history
    figures = (
        len(history),
        num_processes,
        progress.tokens_total,
        progress.wall_time_s,
        progress.tokens_total / max(progress.rollout_time_s, 1e-9),
        progress.setup_time_s,
    )
    summary = dict(zip(RUN_FIGURES, figures, strict=True))
    for name in summary_series(history):
        values = [row[name] for row in history if name in row]
        if values:
            # The first step samples from the initial policy: the starting point. The end is averaged for stability,
            # over the steps that have a value (a source that scored none of a step's responses has NaN, as trl
            # leaves such a step out of its averages).
            summary[f"{name}_first"] = values[0]
            last = [value for value in values[-window:] if not math.isnan(value)]
            summary[f"{name}_last"] = sum(last) / len(last) if last else math.nan
    # The sampler/trainer mismatch over the run, where it is large enough to matter.
    logged = {key for row in history for key in row}
    summary.update(sampler_mismatch_summary({key: [row[key] for row in history if key in row] for key in logged}))
    # Held-out figures: the evaluation before training, and the last one (not averaged: they are few and far apart).
    if progress.evaluations:
        first, last = progress.evaluations[0], progress.evaluations[-1]
        for name in (key for key in last if key.startswith("eval/")):
            summary[f"{name}_first"] = first.get(name, float("nan"))
            summary[f"{name}_last"] = last[name]
    return summary
