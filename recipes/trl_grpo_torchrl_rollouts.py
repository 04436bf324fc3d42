"""trl's own ``GRPOTrainer`` sampling through TorchRL, its rollouts kept in a TorchRL storage.

1. Prompts. The data's prompts (``data=``), as message lists with their rows' other columns, fill a TorchRL
   ``ReplayBuffer`` that trl reads as a stream: ``interop.TorchRLBufferDataset(...).as_hf_dataset()``.
2. Rollouts. trl hands each process's prompts to ``interop.TorchRLRolloutFunc`` (its ``rollout_func``), which samples
   with the library's TorchRL sampler (``interop.CausalLMSampler``: one decoding loop that records each token's
   log-prob) around the very model trl trains: every optimizer step is in the next batch's weights, with no copy and
   no sync. Its settings are trl's (``train.max_completion_length``, ``temperature``, ``top_k``...).
3. Rewards and the update: trl's, unchanged (``reward_funcs``: the reward model and ``reward.functions``, weighted by
   ``reward_weights``; its advantages, loss, optimizer, scheduler, checkpoints and accelerate). ``model.lora``
   becomes trl's ``peft_config``: trl trains the adapters, the sampler samples with them, and the reference is the
   model with them off.
4. Storage. ``interop.TorchRLGRPOTrainer`` (trl's trainer, reading what it scored) writes every completion trl trains
   on, with its rewards, advantage and step, to ``<run dir>/rollouts/rank_<r>/part_<k>/``
   (``recipes.trl_grpo.rollout_store``), readable while the run trains.

    python recipes/trl_grpo_torchrl_rollouts.py
    python recipes/trl_grpo_torchrl_rollouts.py -m seed=0,1,2
    accelerate launch --multi_gpu --num_processes 2 recipes/trl_grpo_torchrl_rollouts.py device=cpu hydra.run.dir=out
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from pathlib import Path

import hydra
import torch
from accelerate import PartialState
from omegaconf import DictConfig
from transformers import TrainerCallback

from interop import TorchRLRolloutFunc
from recipes.common.callbacks import make_finite_guard, make_record_masker
from recipes.common.checkpoint import latest_trl_checkpoint, save_model_folder, write_folder_atomically
from recipes.common.config import RunStopped, hand_token_to_environment, masked_fields
from recipes.common.data import load_prompt_rows
from recipes.common.lora import make_lora_config
from recipes.common.metrics import MetricLogger, peak_device_memory
from recipes.common.models import load_causal_lm, load_reward_model, load_tokenizer
from recipes.common.prompts import PromptTable, make_prompt_stream
from recipes.common.reward_functions import resolve_function
from recipes.common.run import (
    end_processes,
    exit_if_jobs_failed,
    run_recipe,
    seed_everything,
    start_run,
    track_failed_jobs,
)
from recipes.common.text_metrics import distinct_bigrams
from recipes.trl_grpo.checks import validate
from recipes.trl_grpo.rollout_store import ROLLOUTS_DIR, RolloutStore

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- builders


def make_grpo_config(cfg: DictConfig):
    """``trl.GRPOConfig`` from ``train:``, with the device and reward weights this run decides. trl reports to nothing
    itself: its logs go through the recipe's logger (:class:`MetricsCallback`)."""
    weights = ([cfg.reward.model_weight] if cfg.reward_model is not None else []) + [
        float(node.get("weight", 1.0)) for node in cfg.reward.functions.values()
    ]
    args = hydra.utils.instantiate(
        cfg.train, _convert_="all", use_cpu=cfg.device == "cpu", report_to="none", reward_weights=weights
    )
    hand_token_to_environment(args)  # never pickled into trl's checkpoints
    return args


def make_reward_funcs(cfg: DictConfig, *, device: str):
    """trl's ``reward_funcs`` and ``reward_processing_classes``: the reward model (when ``reward_model`` is set), then
    each ``reward.functions`` entry under its config name (trl logs ``rewards/<name>/mean``)."""
    funcs, classes = [], []
    if cfg.reward_model is not None:
        tokenizer = load_tokenizer(cfg.reward_model, padding_side="right")
        model = load_reward_model(cfg.reward_model, device=device, dtype=cfg.dtype, pad_token_id=tokenizer.pad_token_id)
        funcs.append(model.eval())
        classes.append(tokenizer)
    for name, node in cfg.reward.functions.items():
        function = resolve_function(f"reward.functions.{name}.function", node.function)

        def named(*args, _function=function, **kwargs):
            return _function(*args, **kwargs)

        named.__name__ = str(name)
        funcs.append(named)
        classes.append(None)
    return funcs, classes


def make_rollout_store(cfg: DictConfig, run, table: PromptTable, rollout_func, trainer) -> RolloutStore:
    prompt_width = max(len(ids) for ids in rollout_func.tokenize(table.conversations, trainer))
    return RolloutStore(
        run.output_dir / ROLLOUTS_DIR,
        rank=run.processes.process_index,
        max_rows=cfg.rollout.store.max_rows,
        prompt_width=prompt_width,
        completion_width=trainer.args.max_completion_length,
        source_names=list(trainer.reward_func_names),
        max_text_bytes=cfg.rollout.store.max_text_bytes,
        pad_token_id=rollout_func.tokenizer.pad_token_id,
    )


# ---------------------------------------------------------------------------------------------------- metrics

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


def metric_name(trl_key: str) -> str:
    """A trl log key as the recipes name it: the GRPO recipe's name where it logs the same figure (``reward`` ->
    ``rollout/reward_mean``, ``completions/mean_length`` -> ``rollout/response_length``, ``kl`` ->
    ``train/kl_to_ref``...), else ``rollout/<key>`` for what describes the sampled batch (``rewards/<n>/mean``,
    ``completions/...``) and ``train/<key>`` for the update (``loss``, ``grad_norm``)."""
    if trl_key in _GRPO_NAMES:
        return _GRPO_NAMES[trl_key]
    if trl_key in _ROLLOUT_KEYS or trl_key.startswith(("rewards/", "completions/")):
        return f"rollout/{trl_key}"
    return f"train/{trl_key}"


class MetricsCallback(TrainerCallback):
    """trl's training logs, renamed (:func:`metric_name`), with the recipe's figures of the batches they cover (the
    oracle's mean over every process's completions, distinct-2), to the run's logger; a progress line every ``every``
    steps; the series the summary reports (:attr:`series`: name -> [value per log]).

    Args:
        logger: the run's metric logger.
        trainer: the ``interop.TorchRLGRPOTrainer`` (its ``last_scored`` rows and ``rollout_func.last_rollout``).
        oracle: ``text -> float``, the data's ground truth, or ``None``.
    """

    def __init__(self, logger: MetricLogger, trainer, oracle, *, total_steps: int, every: int) -> None:
        self.logger, self.trainer, self.oracle = logger, trainer, oracle
        self.total_steps, self.every = total_steps, every
        self.series: dict[str, list[float]] = {}
        self.trainer_figures: dict[int, dict[str, float]] = {}  # step -> the figures of the batch it trained first
        self._batches_seen = 0

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
            device = self.trainer.accelerator.device
            totals = self.trainer.accelerator.gather(torch.tensor([[sum(scores), len(scores)]], device=device)).sum(0)
            figures["rollout/oracle_mean"] = float(totals[0] / totals[1])
        return figures

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs:
            return
        metrics = {
            metric_name(key): value
            for key, value in logs.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        covered = [step for step in self.trainer_figures if step <= state.global_step]
        for name in {name for step in covered for name in self.trainer_figures[step]}:
            values = [self.trainer_figures[step][name] for step in covered if name in self.trainer_figures[step]]
            metrics[name] = sum(values) / len(values)
        for step in covered:
            del self.trainer_figures[step]
        self.logger.log(metrics, step=state.global_step)
        for name, value in metrics.items():
            self.series.setdefault(name, []).append(value)
        if args.process_index == 0 and (state.global_step % self.every == 0 or state.global_step == self.total_steps):
            shown = [("reward", "rollout/reward_mean"), ("oracle", "rollout/oracle_mean"), ("loss", "train/loss")]
            log.info(
                "Step %d/%d: %s",
                state.global_step,
                self.total_steps,
                ", ".join(f"{label} {metrics[key]:.3f}" for label, key in shown if key in metrics),
            )


# ---------------------------------------------------------------------------------------------------- recipe


def train(cfg: DictConfig) -> dict:
    """Runs trl's GRPO with TorchRL rollouts end to end; returns the summary written to ``summary.json``."""
    start = time.perf_counter()
    cfg = validate(cfg)
    seed_everything(cfg.seed)
    args = make_grpo_config(cfg)  # trl sets up the processes (under a launcher) first; start_run joins them
    run = start_run(cfg, resume=cfg.resume)
    with run:
        args.output_dir = run.broadcast(args.output_dir)
        tokenizer = load_tokenizer(cfg.model, padding_side="left")
        model = load_causal_lm(cfg.model, device=args.device, dtype=cfg.dtype)
        table = PromptTable(load_prompt_rows(cfg.data, "train"), tokenizer=tokenizer, system_prompt=cfg.system_prompt)
        reward_funcs, reward_classes = make_reward_funcs(cfg, device=args.device)
        # The library's default sampler: a CausalLMSampler around the model trl trains, at train:'s sampling settings.
        rollout_func = TorchRLRolloutFunc(tokenizer=tokenizer)
        oracle = hydra.utils.instantiate(cfg.data.oracle) if cfg.data.oracle is not None else None
        trainer = make_trainer(
            model,
            tokenizer,
            args,
            make_prompt_stream(table, batch_size=cfg.rollout.prompts_per_draw, seed=cfg.seed),
            reward_funcs=reward_funcs,
            reward_classes=reward_classes,
            rollout_func=rollout_func,
            peft_config=make_lora_config(cfg.model.lora, task_type="CAUSAL_LM") if cfg.model.lora else None,
        )
        store = make_rollout_store(cfg, run, table, rollout_func, trainer)
        rollout_func.replay_buffer = store  # every scored batch is written there (interop.TorchRLGRPOTrainer)
        guard = make_finite_guard()
        trainer.add_callback(guard)
        trainer.add_callback(make_record_masker(masked_fields(cfg, "train")))
        metrics = MetricsCallback(
            run.logger, trainer, oracle, total_steps=args.max_steps, every=max(1, args.max_steps // 6)
        )
        trainer.add_callback(metrics)  # every process: it gathers each batch's figures (logged by the main one)
        log_run_plan(cfg, args, trainer, run)
        train_start = time.perf_counter()
        trainer.train(resume_from_checkpoint=latest_trl_checkpoint(args.output_dir) if cfg.resume else None)
        train_s = time.perf_counter() - train_start
        local_tokens = torch.tensor([store.tokens], device=trainer.accelerator.device)
        generated_tokens = int(trainer.accelerator.gather(local_tokens).sum())
        if guard.reason is not None:
            raise RunStopped(
                f"Training stopped at {guard.reason}: a model trained on would be garbage, so none is saved. Lower "
                f"train.learning_rate (now {args.learning_rate}), then run again."
            )
        summary = None
        if run.is_main:
            write_folder_atomically(
                functools.partial(save_model_folder, trainer.model, tokenizer), run.output_dir / "model"
            )
            (run.output_dir / "trainer_log.json").write_text(json.dumps(trainer.state.log_history, indent=1))
            summary = summarize(
                trainer,
                store,
                metrics.series,
                generated_tokens,
                train_s=train_s,
                wall_time_s=time.perf_counter() - start,
            )
        summary = run.broadcast(summary)
        return run.finish(summary, closing_message(summary, run.output_dir))


def make_trainer(
    model, tokenizer, args, train_dataset, *, reward_funcs, reward_classes, rollout_func, peft_config=None
):
    """trl's ``GRPOTrainer`` sampling through ``rollout_func``, each scored batch written to the rollout function's
    buffer (``interop.TorchRLGRPOTrainer``).

    ``peft_config`` (``model.lora``): trl adds the adapters to ``model`` in place (peft's ``get_peft_model``), so the
    rollout function's sampler, built around the trainer's model, samples with them; trl's reference is the model with
    them switched off.
    """
    from interop import TorchRLGRPOTrainer  # imports trl: only once the config is valid

    return TorchRLGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        reward_processing_classes=reward_classes,
        rollout_func=rollout_func,
        peft_config=peft_config,
    )


def log_run_plan(cfg: DictConfig, args, trainer, run) -> None:
    if run.is_main:
        log.info(
            "trl GRPOTrainer with TorchRL rollouts: %s, %d steps of %d completions (groups of %d) per process, "
            "%d process(es), rewards %s (weights %s), loss %s, beta %s, lr %s; rollouts stored in %s",
            cfg.model.name_or_path,
            args.max_steps,
            args.per_device_train_batch_size,
            args.num_generations,
            run.processes.num_processes,
            list(trainer.reward_func_names),
            list(args.reward_weights),
            args.loss_type,
            args.beta,
            args.learning_rate,
            run.output_dir / ROLLOUTS_DIR,
        )


def summarize(
    trainer,
    store: RolloutStore,
    series: dict[str, list[float]],
    generated_tokens: int,
    *,
    train_s: float,
    wall_time_s: float,
) -> dict:
    """First and last of every logged rollout figure and of the loss, the rollouts stored (this process's), the
    completion tokens generated (every process's) and the times."""
    summary = {}
    for name, values in sorted(series.items()):
        if name.startswith("rollout/") or name in ("train/loss", "train/kl_to_ref", "train/entropy"):
            summary[f"{name}_first"], summary[f"{name}_last"] = values[0], values[-1]
    summary.update(
        {
            "train/steps": trainer.state.global_step,
            "rollouts/rows": store.rows,
            "rollouts/rows_dropped": store.dropped,
            "rollout/generated_tokens": generated_tokens,
            "perf/train_s": train_s,
            "perf/steps_per_s": trainer.state.global_step / train_s if train_s else math.nan,
            "perf/tokens_per_s": generated_tokens / train_s if train_s else math.nan,
            "perf/wall_time_s": wall_time_s,
            **peak_device_memory(trainer.args.device),
        }
    )
    return summary


def closing_message(summary: dict, output_dir: Path) -> str:
    oracle = (
        f", oracle {summary['rollout/oracle_mean_first']:.3f} -> {summary['rollout/oracle_mean_last']:.3f}"
        if "rollout/oracle_mean_last" in summary
        else ""
    )
    first, last = summary.get("rollout/reward_mean_first", math.nan), summary.get("rollout/reward_mean_last", math.nan)
    return (
        f"trl GRPO with TorchRL rollouts: {summary['train/steps']} steps, reward {first:.3f} -> {last:.3f}{oracle}; "
        f"model in {output_dir / 'model'}, {summary['rollouts/rows']} rollouts in {output_dir / ROLLOUTS_DIR} "
        "(recipes.trl_grpo.rollout_store.load_rollouts reads them)."
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="trl_grpo_torchrl_rollouts")
def main(cfg: DictConfig) -> float:
    summary = run_recipe(train, cfg, last_checkpoint=lambda cfg: latest_trl_checkpoint(str(cfg.train.output_dir)))
    if PartialState().is_main_process and "train/steps" in summary:  # a failed sweep job says so in its log instead
        print(json.dumps(summary, indent=2))
    return summary[cfg.metric]


if __name__ == "__main__":
    track_failed_jobs()
    main()
    end_processes()
    exit_if_jobs_failed()
