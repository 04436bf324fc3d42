"""GRPO built from TorchRL components, rewarded by a Hugging Face reward model through ``interop``.

    python recipes/grpo_torchrl_rm.py                                     # tiny policy + tiny RM, ~15 s on 2 CPUs
    python recipes/grpo_torchrl_rm.py -m optimizer.lr=1e-3,2e-3,4e-3      # a sweep: main() returns cfg.metric
    torchrun --standalone --nproc_per_node 2 recipes/grpo_torchrl_rm.py hydra.run.dir=outputs/ddp  # data-parallel
    python recipes/grpo_torchrl_rm.py rollout.mode=async rollout.backend=ray rollout.workers=2  # samplers on Ray

How a step flows (env -> policy -> reward -> collector -> advantage -> buffer -> loss) is told once, in docs/grpo.md.
This file reads top to bottom: :func:`train` validates the config (``recipes.grpo.checks``), reads the
prompts, starts the run, loads the models (:func:`load_models`), builds the learner (``recipes.grpo.learner``) and the
collector (``recipes.grpo.collector``), then :func:`train_loop` runs one :func:`train_step` per step, reports it
(``recipes.grpo.report``) and checkpoints it (:func:`save_if_due`, ``recipes.grpo.checkpointing``); the run ends with
``summary.json`` and a closing message.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) every process joins one process group (gloo on CPU,
nccl on CUDA, each process on ``cuda:<LOCAL_RANK>``) and collects its own ``responses_per_step`` responses: the
prompt stream is dealt out between the processes and each samples with its own seed (``seed + rank``). The loss runs
through a ``DistributedDataParallel`` wrapper of the policy's log-prob scorer (or FSDP2 with
``distributed.strategy=fsdp``), so every update applies the gradients averaged over all processes; metrics are
averaged over the processes before rank 0 alone logs them, saves checkpoints and writes ``summary.json``. Every
process gets the same ``hydra.run.dir`` (pass one explicitly, so that Hydra does not create a folder per process).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import hydra
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from omegaconf import DictConfig
from tqdm.auto import tqdm

from recipes.common.checkpoint import latest_checkpoint, list_checkpoints
from recipes.common.config import ConfigError, RunStopped
from recipes.common.data import PromptRows, load_prompt_rows
from recipes.common.dotted_paths import instantiate_function
from recipes.common.metrics import barely_learned_line, peak_device_memory
from recipes.common.models import load_causal_lm, load_tokenizer
from recipes.common.rollout_backend import ray_connection, samples_apart
from recipes.common.run import (
    Run,
    end_processes,
    exit_if_jobs_failed,
    mask_sweep_logs,
    run_recipe,
    seed_everything,
    start_run,
    track_failed_jobs,
)
from recipes.common.schema import config_view, refuse_unknown_overrides
from recipes.common.sharding import gather_full_model_state, gather_full_state, is_sharded, load_full_optimizer_state
from recipes.common.tools import resolving_tools_once
from recipes.grpo.batch import LOSS_MASK, POLICY_VERSION, REWARD_LOGS, merge_batches
from recipes.grpo.checkpointing import (
    REFERENCE_FOLDER,
    TrainingProgress,
    capture_rng_state,
    checkpoint_policy_node,
    checkpoint_root,
    finished_run_summary,
    load_training_state,
    record_resume,
    restore_rng_state,
    resume_changes,
    resumed_config,
    save_checkpoint,
    truncate_metrics_csv,
)
from recipes.grpo.checks import check_prompt_lengths, validate, validated
from recipes.grpo.collector import make_collector
from recipes.grpo.distributed import check_ranks_in_sync, mean_over_processes, pool_over_processes
from recipes.grpo.evaluation import Evaluator, eval_due
from recipes.grpo.learner import (
    Learner,
    check_weights_finite,
    informative_batch,
    make_learner,
    make_replay_buffer,
    optimize,
)
from recipes.grpo.policy import load_policy
from recipes.grpo.report import (
    closing_message,
    is_source_figure,
    logged_metrics,
    report_step,
    rollout_metrics,
    run_description,
    sample_rollouts,
    summarize,
)
from recipes.grpo.rewards import load_reward_scorer, source_names
from recipes.grpo.schema import RENAMED, TRL_NAMES, GRPORecipeConfig

__all__ = ["train", "validate"]

log = logging.getLogger(__name__)


# The run reads its typed settings (``cfg``: a ``GRPORecipeConfig``, built by ``validate``), never the composed
# DictConfig. The resolved DictConfig stays beside them as ``run_record``, where a DictConfig is the point: the run's
# resolved_config.yaml and logger config (secrets masked), what a resume changes. ``recipes.common.models`` and
# ``recipes.common.data`` take model and data nodes as DictConfigs (they merge nodes with OmegaConf, read columns by
# name): ``config_view``.

# ---------------------------------------------------------------------------------------------------------- load


@dataclass
class Models:
    """What the learner loads: the policy and its tokenizer, the frozen reference, and the reward model and its
    tokenizer (``None`` when the collectors run apart from the learner, ``rollout.backend``: each loads its own)."""

    tokenizer: Any
    policy: Any
    reference: Any | None
    reward_tokenizer: Any | None
    reward_model: Any | None


def load_models(cfg: GRPORecipeConfig, *, resume_from: Path | None) -> Models:
    """The policy comes from the checkpoint when resuming; the reference is always the initial policy (with LoRA, the
    policy with its adapters off: nothing more is loaded)."""
    policy_node = cfg.model if resume_from is None else checkpoint_policy_node(cfg, resume_from)
    # Fresh LoRA adapters are drawn at random: seeded alike on every rank, the same run starts from the same adapters
    # (and FSDP2's ranks, each keeping its own slice of them, from one draw). seed_sampling reseeds per rank later.
    seed_everything(cfg.seed)
    reference = None
    if cfg.loss.kl_to_ref_coeff and cfg.model.lora is None:
        # The initial policy; with loss.sync_ref_model, the reference as the checkpoint saved it (it moves).
        reference_node = cfg.model
        if resume_from is not None and (resume_from / REFERENCE_FOLDER).is_dir():
            reference_node = replace(cfg.model, name_or_path=str(resume_from / REFERENCE_FOLDER))
        reference = load_causal_lm(config_view(reference_node), device=cfg.device, dtype=cfg.dtype)
        reference = reference.eval().requires_grad_(False)
    reward_tokenizer = reward_model = None
    if not samples_apart(cfg):  # elsewhere each collector loads its own
        reward_tokenizer, reward_model = load_reward_scorer(cfg)
    return Models(
        tokenizer=load_tokenizer(config_view(policy_node), padding_side="left"),
        # eval(): GRPO's importance ratios compare forward passes that must not differ by dropout.
        policy=load_policy(
            cfg.model, device=cfg.device, dtype=cfg.dtype, saved=None if resume_from is None else policy_node
        ).eval(),
        reference=reference,
        reward_tokenizer=reward_tokenizer,
        reward_model=reward_model,
    )


def restore_progress(
    cfg: GRPORecipeConfig, run: Run, state: dict | None, learner: Learner, *, policy
) -> TrainingProgress:
    """The run's running totals (history, times, tokens): empty, or the checkpoint's, with its optimizer state and
    learning-rate schedule put back into ``learner``."""
    progress = TrainingProgress()
    if state is None:
        return progress
    optimizer = learner.optimizer
    if is_sharded(policy):  # the full state save_if_due gathered: each rank keeps its shard
        load_full_optimizer_state(policy, optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(state["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])
    learner.optimizer_steps_done = state["optimizer_steps_done"]
    # The config's optimizer settings win over the checkpoint's (an allowed resume change, e.g. the lr, applies: the
    # schedule then scales the new rate from where it stopped).
    settings = {k: v for k, v in asdict(cfg.optimizer).items() if not k.startswith("_")}
    for group in optimizer.param_groups:
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in settings.items() if k in group})
        group["initial_lr"] = settings["lr"]
    learner.scheduler.base_lrs = [settings["lr"]] * len(optimizer.param_groups)
    for group, lr in zip(optimizer.param_groups, learner.scheduler.get_lr(), strict=True):
        group["lr"] = lr
    if run.is_main:
        truncate_metrics_csv(run.output_dir / "metrics.csv", state["step"])
    progress.load_state_dict(state)
    return progress


def seed_sampling(cfg: GRPORecipeConfig, state: dict | None, start_step: int) -> None:
    """Seeded once everything is built, so that the run depends on the seed and not on what loading drew; each rank
    samples its own responses. A resume restores each rank's generators as the checkpoint saved them."""
    processes = PartialState()
    rank, world_size = processes.process_index, processes.num_processes
    if state is None:
        seed_everything(cfg.seed + rank)
        return
    saved = state["rng_by_rank"]
    if len(saved) == world_size:
        restore_rng_state(saved[rank])
        return
    # Another number of processes than the run that saved: the prompt stream continues exactly, the sampling noise
    # cannot, so each rank starts a fresh seed of its own.
    if processes.is_main_process:
        warnings.warn(
            f"Resuming a run of {len(saved)} process(es) with {world_size}: the prompts continue where they "
            "stopped, but the sampling does not replay what an uninterrupted run would have drawn.",
            stacklevel=2,
        )
    seed_everything(cfg.seed + rank + start_step * world_size)


# ---------------------------------------------------------------------------------------------------------- loop


def make_evaluator(cfg: GRPORecipeConfig, models: Models, eval_prompts: PromptRows) -> Evaluator:
    """The held-out evaluation, with the learner's policy; in async mode the reward model is loaded here too (the
    collector's process holds its own)."""
    reward_tokenizer, reward_model = models.reward_tokenizer, models.reward_model
    if reward_model is None:
        reward_tokenizer, reward_model = load_reward_scorer(cfg)
    return Evaluator(
        cfg,
        eval_prompts,
        policy=models.policy,
        tokenizer=models.tokenizer,
        reward_model=reward_model,
        reward_tokenizer=reward_tokenizer,
        oracle=instantiate_function(cfg.data.oracle) if cfg.data.oracle is not None else None,
    )


def evaluate(
    cfg: GRPORecipeConfig, run: Run, evaluator: Evaluator, progress: TrainingProgress, step: int
) -> dict[str, float]:
    """The held-out figures after ``step`` (0: before training), recorded in the run's evaluations; a few of the
    answers go to the log."""
    figures = evaluator(step)
    progress.evaluations.append({"step": step, **figures})
    if run.is_main:
        shown = ", ".join(f"{key.removeprefix('eval/')} {value:.3f}" for key, value in figures.items())
        log.info("Eval after step %d: %s", step, shown)
        for sample in evaluator.samples[: cfg.samples.print_count]:
            log.info("Eval sample: %s", json.dumps(_sample_line(sample), ensure_ascii=False))
    return figures


def _sample_line(sample: dict) -> dict:
    """An eval answer as the log prints it, with the columns its reward functions logged (``log_extra``)."""
    line = {"prompt": sample["prompt"], "response": sample["shown"], "reward": round(sample["reward"], 4)}
    return {
        **line,
        **{name if name not in line else f"extra/{name}": value for name, value in sample["columns"].items()},
    }


def train_loop(
    cfg: GRPORecipeConfig,
    run: Run,
    collector,
    models: Models,
    learner: Learner,
    progress: TrainingProgress,
    *,
    prompts,
    start_step,
    evaluator: Evaluator | None = None,
) -> None:
    """Steps ``start_step + 1 ... train.steps``: collect, update, (evaluate,) report, checkpoint."""
    oracle = instantiate_function(cfg.data.oracle) if cfg.data.oracle is not None else None
    if evaluator is not None and start_step == 0:
        run.logger.log(evaluate(cfg, run, evaluator, progress, 0), step=0)
    bar = tqdm(
        total=cfg.train.steps,
        initial=start_step,
        desc="GRPO",
        unit="step",
        disable=not (cfg.progress_bar and run.is_main),
    )
    batches = iter(collector)
    try:
        for step in range(start_step + 1, cfg.train.steps + 1):
            step_start = time.perf_counter()
            batch = next(batches)  # env -> policy -> reward, here or in the background collector
            drawn, filtered = [batch], 0
            if cfg.advantage.filter_zero_std_groups:  # DAPO's dynamic sampling: more batches, informative groups only
                batch, drawn, filtered = informative_batch(
                    batch,
                    batches,
                    group_size=cfg.rollout.group_size,
                    max_extra_batches=cfg.advantage.max_extra_batches,
                    pad_token_id=models.tokenizer.pad_token_id,
                )
            waited = {"perf/wait_s": time.perf_counter() - step_start}
            extra = {**waited, "rollout/groups_filtered": float(filtered), "rollout/extra_batches": len(drawn) - 1.0}
            sampled = merge_batches(drawn, pad_token_id=models.tokenizer.pad_token_id)
            metrics, tokens = train_step(
                cfg, step, batch, learner, models, collector, oracle, sampled=sampled, extra=extra
            )
            metrics["perf/step_time_s"] = time.perf_counter() - step_start
            if evaluator is not None and eval_due(cfg, step):
                metrics.update(evaluate(cfg, run, evaluator, progress, step))
            progress.add_step(metrics, tokens=tokens)
            samples = functools.partial(
                sample_rollouts, batch, prompts.prompts, models.tokenizer, oracle, source_names=source_names(cfg)
            )
            # async: the lag of every batch trained so far, a histogram in wandb (train/policy_lag: this step's).
            lags = [row["train/policy_lag"] for row in progress.history] if cfg.rollout.mode == "async" else []
            report_step(cfg, run, step, metrics, bar, samples=samples, lags=lags)
            save_if_due(cfg, run, step, models, learner, progress)
    finally:
        bar.close()


def train_step(
    cfg: GRPORecipeConfig, step, batch, learner: Learner, models: Models, collector, oracle, *, sampled, extra
) -> tuple:
    """One GRPO update on ``batch``: advantages, loss mask and reference log-probs, the loss over mini-batches, the new
    weights handed to the collector. ``sampled``: every response the step drew (``batch``, or more with dynamic
    sampling), which its rollout figures describe; ``extra``: more of this rank's figures. Returns the step's metrics
    (averaged over the processes) and its generated tokens."""
    timings = learner.prepare(batch)  # group advantages, loss mask, reference (and missing old) log-probs
    lag = step - 1 - int(batch[POLICY_VERSION].min())
    if lag > cfg.rollout.max_policy_lag:
        raise RuntimeError(
            f"Step {step} got responses sampled {lag} updates ago, more than rollout.max_policy_lag="
            f"{cfg.rollout.max_policy_lag}; the collector did not keep it within the bound "
            f"(rollout.past_lag_bound={cfg.rollout.past_lag_bound})."
        )
    metrics, tokens = rollout_metrics(
        sampled,
        models.tokenizer,
        oracle,
        group_size=cfg.rollout.group_size,
        gather=pool_over_processes,
        source_names=source_names(cfg),
    )
    warn_about_the_batch(cfg, step, batch, metrics)
    learner.buffer = make_replay_buffer(cfg, batch.exclude(REWARD_LOGS))  # the loss reads tensors only
    update_start = time.perf_counter()
    updates = optimize(cfg, learner, batch)
    learner.buffer = None
    push_start = time.perf_counter()
    if step % cfg.rollout.weight_sync_every == 0:  # the samplers apart from the learner get every k-th version
        collector.update_policy_weights_(models.policy, version=step)
    updates["perf/weight_sync_s"] = time.perf_counter() - push_start  # the learner's share of the push (in update_s)
    updates.update(step_timings(collector.last_timings, timings, lag=lag, update_start=update_start))
    # The sampling workers apart from the learner (rollout.backend=processes|ray): how many, restarts, throughput.
    updates.update({f"rollout/{name}": value for name, value in collector.last_stats.items()})
    updates.update(extra)
    metrics.update(mean_over_processes(updates))  # each rank's diagnostics and times; the rollout figures are global
    metrics["perf/tokens_per_s"] = tokens / metrics["perf/rollout_time_s"]
    # A source that scored none of the step's responses (a trl reward function's None for all) has a NaN mean and
    # std, which trl logs and goes on: only the reward, the loss, the gradients and the weights stop the run.
    unfinished = sorted(key for key, value in metrics.items() if not math.isfinite(value) and not is_source_figure(key))
    if unfinished:
        raise RunStopped(
            f"Step {step}: {unfinished} are not finite ({[metrics[key] for key in unfinished]}); the run stops before "
            "any checkpoint is written after it. Lower optimizer.lr, or check the reward sources, then start again."
        )
    metrics.update(reward_function_metrics(sampled, known=metrics, prefix="rollout"))
    return metrics, tokens


def reward_function_metrics(data, *, known: dict, prefix: str) -> dict[str, float]:
    """What the trl reward functions logged while ``data`` was scored (``log_metric``: ``<prefix>/<name>``, averaged
    as trl averages them; whatever they log, even NaN, is theirs to read and stops nothing); a name that is one of
    the recipe's own figures (``known``) is refused rather than overwriting it."""
    logged = logged_metrics(data, prefix=prefix)
    taken = sorted(key for key in logged if key in known)
    if taken:
        raise RunStopped(
            f"A reward function logged {[key.removeprefix(prefix + '/') for key in taken]} (log_metric), which the "
            f"recipe reports itself as {taken}: its value would replace the recipe's. Rename it in the function."
        )
    return logged


def warn_about_the_batch(cfg: GRPORecipeConfig, step: int, batch, metrics: dict) -> None:
    """Says when a step teaches nothing: every group's rewards tie, or every response is masked as truncated."""
    if metrics["rollout/frac_reward_zero_std"] == 1.0 and not cfg.advantage.filter_zero_std_groups:
        log.warning(
            "Step %d: in every group the responses got the same reward, so this step teaches nothing. A reward model "
            "that scores everything alike, reward.max_length shorter than the prompts, or responses that are all the "
            "same (temperature too low) do this.",
            step,
        )
    if cfg.loss.mask_truncated_completions and not bool(batch.get(LOSS_MASK).any()):
        log.warning(
            "Step %d: every response hit rollout.generation.max_new_tokens=%d, and "
            "loss.mask_truncated_completions=true leaves them all out of the loss: this step trains nothing. Raise "
            "max_new_tokens, or set "
            "loss.mask_truncated_completions=false.",
            step,
            cfg.rollout.generation["max_new_tokens"],
        )


def step_timings(collected: dict, prepared: dict, *, lag: int, update_start: float) -> dict:
    """A step's phase times (``perf/*``) and its policy lag, from the collector's and the preparation's timings."""
    return {
        "train/policy_lag": float(lag),
        "perf/generate_s": collected["generate_s"],
        "perf/reward_s": collected["collect_s"] - collected["generate_s"],
        "perf/advantage_s": prepared["advantage_s"],
        "perf/reference_s": prepared["log_probs_s"],
        "perf/update_s": time.perf_counter() - update_start,
        # Where the responses were collected (here or in the background), plus their preparation.
        "perf/rollout_time_s": collected["collect_s"] + prepared["advantage_s"] + prepared["log_probs_s"],
    }


# ---------------------------------------------------------------------------------------------------------- checkpoint


def save_if_due(
    cfg: GRPORecipeConfig, run: Run, step: int, models: Models, learner: Learner, progress: TrainingProgress
) -> None:
    """A checkpoint every ``checkpoint.every_n_steps`` steps and at the last: the policy, the optimizer and its
    schedule, the running totals, every rank's RNG state (so that a resumed run samples as this one would have) and,
    with ``loss.sync_ref_model``, the reference as it moved. A sharded model's weights and optimizer state are
    gathered whole onto rank 0 first: one ``from_pretrained`` folder, as under DDP."""
    optimizer = learner.optimizer
    every = cfg.checkpoint.every_n_steps
    if not (step == cfg.train.steps or (every is not None and step % every == 0)):
        return
    check_weights_finite(learner.parameters)
    check_ranks_in_sync(models.policy)
    rng_by_rank = gather_object([capture_rng_state()])
    model, model_state, optimizer_state = models.policy, None, None
    if is_sharded(models.policy):
        model_state, optimizer_state = gather_full_state(models.policy, optimizer)
    reference = None
    if learner.synced_reference is not None:
        reference = (
            models.reference,
            gather_full_model_state(models.reference) if is_sharded(models.reference) else None,
        )
    if run.is_main:
        if model_state is not None and cfg.checkpoint.save_merged:
            # The merge runs on a whole LoRA policy: rebuilt on this process's CPU from the gathered weights.
            model, model_state = whole_policy_on_cpu(cfg, model_state), None
        save_checkpoint(
            checkpoint_root(cfg),
            step,
            model=model,
            tokenizer=models.tokenizer,
            optimizer=optimizer,
            state={
                **progress.state_dict(),
                "rng_by_rank": rng_by_rank,
                "scheduler": learner.scheduler.state_dict(),
                "optimizer_steps_done": learner.optimizer_steps_done,
            },
            keep_last=cfg.checkpoint.keep_last,
            model_state_dict=model_state,
            optimizer_state_dict=optimizer_state,
            save_merged=cfg.checkpoint.save_merged,
            reference=reference,
        )


def whole_policy_on_cpu(cfg: GRPORecipeConfig, full_state: dict):
    """A sharded policy rebuilt whole on CPU from its gathered weights (``gather_full_state``): the base read again
    with its adapters, then every weight replaced by the gathered one. Building it draws the adapters' initial
    weights from torch's generator: on a fork of it, or this process would sample from another point of its random
    stream than the run a resume replays (whose saved state is from before the save)."""
    with torch.random.fork_rng(devices=[]):
        policy = load_policy(cfg.model, device="cpu", dtype=cfg.dtype)
    policy.load_state_dict(full_state)
    return policy


def record_resume_changes(cfg: DictConfig, output_dir: Path) -> None:
    """The settings this resume changes (allowed in validate()), recorded before the new config replaces the old:
    ``cfg`` is the run's record (the resolved config, as ``resolved_config.yaml`` holds it), compared with the saved
    one."""
    step = list_checkpoints(checkpoint_root(cfg))[-1][0]
    changes = resume_changes(cfg)
    record_resume(output_dir, step=step, changes=changes)
    log.info("Resuming %s at step %d%s", output_dir, step, f" with changes {changes}" if changes else "")


# ---------------------------------------------------------------------------------------------------------- run


@resolving_tools_once()  # each MCP server of tools: listed once per run
def train(composed: DictConfig) -> dict:
    """Runs (or resumes) GRPO as configured by the ``composed`` config (Hydra's) and returns the summary also written
    to ``summary.json``.

    Under torchrun every process calls it; each returns the same summary (metrics are averaged over the processes),
    and rank 0 alone writes the run folder."""
    setup_start = time.perf_counter()
    # Typed settings (resolved; a resumed run's own settings restored; LoRA switched on or off), and the run's record.
    cfg, run_record = validated(composed)
    finished = finished_run_summary(cfg)
    if finished is not None:
        log.info(
            "The run in %s already finished its %d steps: nothing to resume (raise train.steps to train further).",
            cfg.output_dir,
            finished["train/steps"],
        )
        return finished
    # The prompts are read (and refused: missing column, empty prompts, too long...) before any model loads.
    prompts = load_prompt_rows(config_view(cfg.data), "train")
    if not prompts:
        raise ConfigError(f"data={cfg.data.source} holds no training prompts; check data.path / data.split.")
    check_prompt_lengths(cfg, prompts)
    eval_prompts = None
    if cfg.eval.every_n_steps is not None:
        eval_prompts = load_prompt_rows(config_view(cfg.data), "eval")
        if not eval_prompts:
            raise ConfigError(f"eval.every_n_steps is set, but data={cfg.data.source}'s eval split holds no prompts.")
        check_prompt_lengths(cfg, eval_prompts)

    run = start_run(
        run_record,  # written as the run's resolved_config.yaml (secrets masked), and the logger's config
        tidy=[checkpoint_root(cfg)],
        resume=cfg.resume,
        # A resume records what it changes against the run's records: both sides as resolved_config.yaml holds them.
        before_config=functools.partial(record_resume_changes, run_record) if cfg.resume else None,
        backend=None if cfg.distributed.backend == "auto" else cfg.distributed.backend,
    )
    # Every process's folder is the main process's (start_run broadcast it into the record): its checkpoints too.
    cfg.output_dir = str(run.output_dir)
    # The logger closes however the run ends (Hydra multirun jobs share this process); rollout.backend=ray: the
    # cluster joined (or started, and stopped at the end) before any model loads.
    with run, ray_connection(cfg):
        return _train(cfg, run, prompts=prompts, eval_prompts=eval_prompts, setup_start=setup_start)


def _train(
    cfg: GRPORecipeConfig, run: Run, *, prompts: PromptRows, eval_prompts: PromptRows | None, setup_start: float
) -> dict:
    """Loads the models (the policy from the newest checkpoint when resuming), builds the learner and the collector,
    trains and summarises."""
    resume_from = latest_checkpoint(checkpoint_root(cfg)) if cfg.resume else None
    state = load_training_state(resume_from) if resume_from is not None else None
    start_step = state["step"] if state is not None else 0
    models = load_models(cfg, resume_from=resume_from)
    learner = make_learner(cfg, models)
    progress = restore_progress(cfg, run, state, learner, policy=models.policy)
    evaluator = make_evaluator(cfg, models, eval_prompts) if eval_prompts is not None else None
    processes, collector = run.processes, None
    try:
        # Last, and inside the try: collectors apart from the learner (child processes, Ray actors) are stopped by
        # the finally below, however the run ends.
        collector = make_collector(
            cfg,
            models,
            prompts=prompts,
            start_step=start_step,
            num_replicas=processes.num_processes,
            rank=processes.process_index,
        )
        seed_sampling(cfg, state, start_step)
        if run.is_main:
            log.info(run_description(cfg, num_prompts=len(prompts), world_size=processes.num_processes))
        progress.setup_time_s = time.perf_counter() - setup_start
        train_loop(
            cfg, run, collector, models, learner, progress, prompts=prompts, start_step=start_step, evaluator=evaluator
        )
    finally:
        if collector is not None:
            collector.shutdown()
        if evaluator is not None:
            evaluator.close()
    summary = summarize(progress, window=cfg.summary.window, num_processes=processes.num_processes)
    summary.update(peak_device_memory(cfg.device))
    return run.finish(summary, closing_message(summary, run.output_dir), warn=bool(barely_learned_line(summary)))


@hydra.main(version_base="1.3", config_path="../conf", config_name="grpo_torchrl_rm")
def main(cfg: DictConfig) -> float:
    # TorchRL 0.14.1's own internals trigger these; there is nothing a user of the recipe can do about them.
    warnings.filterwarnings("ignore", message="size_average and reduce args will be deprecated")
    warnings.filterwarnings("ignore", message="The env passed to LLMCollector is missing transforms")
    summary = run_recipe(train, cfg)  # Hydra's composed config: train() checks it
    # A resumed run reports the metric its own config names (its resolved_config.yaml), not the YAML default's.
    metric = resumed_config(cfg).metric if cfg.resume else cfg.metric
    return summary.get(metric, float("nan"))


if __name__ == "__main__":
    refuse_unknown_overrides(
        sys.argv[1:], GRPORecipeConfig, recipe="grpo_torchrl_rm", aliases=TRL_NAMES, renamed=RENAMED
    )
    track_failed_jobs()
    mask_sweep_logs()
    main()
    end_processes()
    exit_if_jobs_failed()
