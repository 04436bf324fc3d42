"""trl's own ``GRPOTrainer`` sampling through TorchRL, its rollouts kept in a TorchRL storage.

1. Prompts. The data's prompts (``data=``), as message lists with their rows' other columns, fill a TorchRL
   ``ReplayBuffer`` that trl reads as a stream: ``interop.TorchRLBufferDataset(...).as_hf_dataset()``.
2. Rollouts. trl hands each process's prompts to ``interop.TorchRLRolloutFunc`` (its ``rollout_func``), which samples
   with the library's TorchRL sampler (``interop.CausalLMSampler``: one decoding loop that records each token's
   log-prob) around the very model trl trains: every optimizer step is in the next batch's weights, with no copy and
   no sync. Its settings are the GRPO recipe's keys (``rollout.group_size``, ``rollout.generation.*``), handed to
   trl's ``GRPOConfig`` as its fields (``num_generations``, ``max_completion_length``, ``temperature``...), which the
   rollout function reads back.
3. Rewards and the update: trl's, unchanged (``reward_funcs``: the reward model and ``reward.functions``, weighted by
   ``reward_weights``; its advantages, loss, optimizer, scheduler, checkpoints and accelerate). ``model.lora``
   becomes trl's ``peft_config``: trl trains the adapters, the sampler samples with them, and the reference is the
   model with them off.
4. Storage. ``interop.TorchRLGRPOTrainer`` (trl's trainer, reading what it scored) writes every completion trl trains
   on, with its rewards, advantage and step, to ``<run dir>/rollouts/rank_<r>/part_<k>/``
   (``recipes.trl_grpo.rollout_store``), readable while the run trains.
5. Tools (``tools.<name>.function``, ``tools.<label>.mcp.servers``, ``rollout.max_turns``). The rollout function
   samples whole dialogs: the model writes, its calls run in a worker process, their results join the completion as
   tool messages, it writes on;
   trl gets ``env_mask`` with them, so its loss skips the tool messages' tokens. ``eval.every_n_steps`` answers the
   data's held-out prompts the same way and logs ``eval/accuracy`` (``recipes.trl_grpo.evaluation``).
6. Resume. ``resume=true`` continues the run folder from the newest of trl's checkpoints, with the run's own settings
   (changes named in ``resume_allow_changes``), as the GRPO recipe does (``recipes.trl_grpo.resume``); its summary
   covers the whole run, and a run that reached ``train.max_steps`` has nothing to resume.

    python recipes/trl_grpo_torchrl_rollouts.py
    python recipes/trl_grpo_torchrl_rollouts.py -m seed=0,1,2
    python recipes/trl_grpo_torchrl_rollouts.py experiment=calculator     # a tool-using policy
    accelerate launch --multi_gpu --num_processes 2 recipes/trl_grpo_torchrl_rollouts.py device=cpu hydra.run.dir=out
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
import time

import hydra
import torch
from accelerate import PartialState
from omegaconf import DictConfig
from transformers import PrinterCallback, ProgressCallback

from interop import GroupReplay, TorchRLRolloutFunc
from recipes.common.callbacks import make_finite_guard, make_record_masker
from recipes.common.checkpoint import latest_trl_checkpoint, save_model_folder, write_folder_atomically
from recipes.common.config import RunStopped, hand_token_to_environment, masked_fields
from recipes.common.data import PromptRows, load_prompt_rows
from recipes.common.dotted_paths import instantiate_function, resolve_function
from recipes.common.lora import make_lora_config
from recipes.common.metrics import barely_learned_line
from recipes.common.models import load_causal_lm, load_reward_model, load_tokenizer, tokenizer_fingerprint
from recipes.common.prompts import PromptTable, make_prompt_stream
from recipes.common.rollout_backend import backend_of, ray_connection, worker_resources
from recipes.common.run import (
    end_processes,
    exit_if_jobs_failed,
    mask_sweep_logs,
    run_recipe,
    seed_everything,
    start_run,
    track_failed_jobs,
)
from recipes.common.schema import config_view, refuse_unknown_overrides, trainer_aliases
from recipes.common.tools import resolve_tools, resolving_tools_once
from recipes.trl_grpo.checks import grpo_config_fields, load_replay_source, validated
from recipes.trl_grpo.evaluation import EvalCallback
from recipes.trl_grpo.report import MetricsCallback, StepBar, closing_message, summarize
from recipes.trl_grpo.resume import checkpoint_step, finished_run_summary, record_resume_start, resumed_config
from recipes.trl_grpo.rewards import DeclinedByEverySource, checked_reward_function, refuse_non_finite_scores
from recipes.trl_grpo.rollout_store import ROLLOUTS_DIR, RolloutStore, stored_totals
from recipes.trl_grpo.schema import GRPO_CONFIG_FIELDS, RENAMED, TrlGRPORecipeConfig

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- builders

# The run reads its typed settings (``cfg``: a ``TrlGRPORecipeConfig``, built by ``validate``), never the composed
# DictConfig. The resolved DictConfig stays beside them as ``run_record``, where a DictConfig is the point: the run's
# resolved_config.yaml and logger config (secrets masked), the train: fields trl's logs mask, what a resume changes.
# ``recipes.common.models`` and ``recipes.common.data`` take model and data nodes as DictConfigs (they merge nodes with
# OmegaConf, read columns by name): ``config_view``.


def make_grpo_config(cfg: TrlGRPORecipeConfig):
    """``trl.GRPOConfig`` from ``train:``, with the device and reward weights this run decides and the fields its own
    keys set (``recipes.trl_grpo.checks.grpo_config_fields``: the group size, the sampler's settings, the reward
    aggregation, the progress bar). trl reports to nothing itself: its logs go through the recipe's logger
    (:class:`MetricsCallback`)."""
    weights = ([cfg.reward.model_weight] if cfg.reward_model is not None else []) + [
        float(node.weight) for node in cfg.reward.functions.values()
    ]
    args = hydra.utils.instantiate(
        cfg.train,
        _convert_="all",
        use_cpu=cfg.device == "cpu",
        report_to="none",
        reward_weights=weights,
        **grpo_config_fields(cfg),
    )
    hand_token_to_environment(args)  # never pickled into trl's checkpoints
    if cfg.rollout.mode == "async":
        args.shuffle_dataset = False  # the async sampler reads the TorchRL stream (which shuffles) ahead, as trl will
    return args


def make_reward_funcs(cfg: TrlGRPORecipeConfig, *, device: str):
    """trl's ``reward_funcs`` and ``reward_processing_classes``: the reward model (when ``reward_model`` is set), then
    each ``reward.functions`` entry under its config name (trl logs ``rewards/<name>/mean``).

    Every source's values are checked as they are made (``recipes.trl_grpo.rewards``): a non-finite reward stops the run
    naming its source before anything is trained on it."""
    funcs, classes = [], []
    if cfg.reward_model is not None:
        reward_model = config_view(cfg.reward_model)
        tokenizer = load_tokenizer(reward_model, padding_side="right")
        model = load_reward_model(reward_model, device=device, dtype=cfg.dtype, pad_token_id=tokenizer.pad_token_id)
        # trl names a model source after its config's path: the node's own (an adapter folder's model carries its
        # base's), as recipes.trl_grpo.report.reward_source_names names it.
        model.config.name_or_path = str(cfg.reward_model.name_or_path).rstrip("/")
        refuse_non_finite_scores(model, setting=f"reward_model.name_or_path={str(cfg.reward_model.name_or_path)!r}")
        funcs.append(model.eval())
        classes.append(tokenizer)
    # Without a reward model, a completion every function declines (None) gets no reward: said once, naming them.
    declined = DeclinedByEverySource(list(map(str, cfg.reward.functions))) if cfg.reward_model is None else None
    for name, node in cfg.reward.functions.items():
        function = resolve_function(f"reward.functions.{name}.function", node.function)
        funcs.append(checked_reward_function(function, name=str(name), declined=declined))
        classes.append(None)
    return funcs, classes


def make_prompt_table(cfg: TrlGRPORecipeConfig, rows: PromptRows, tokenizer) -> PromptTable:
    """The prompts as message lists, ``rollout.system_prompt`` first where set (the rollout function renders them
    with the chat template and the tools' schemas)."""
    return PromptTable(rows, tokenizer=tokenizer, system_prompt=cfg.rollout.system_prompt)


def make_rollout_store(cfg: TrlGRPORecipeConfig, run, table: PromptTable, rollout_func, trainer) -> RolloutStore:
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
        tokenizer=tokenizer_fingerprint(rollout_func.tokenizer),
        group_size=trainer.args.num_generations,
    )


def make_rollout_func(cfg: TrlGRPORecipeConfig, tokenizer) -> TorchRLRolloutFunc:
    """trl's ``rollout_func``: the library's default sampler (a ``CausalLMSampler`` around the model trl trains, at
    ``rollout.generation``'s settings, which it reads from trl's ``GRPOConfig``), sampling when trl asks or one
    generation batch ahead (``rollout.mode``), in trl's process or in ``rollout.workers`` workers apart from it
    (``rollout.backend``: local processes or Ray actors). With ``tools:``, whole dialogs
    (``interop.tools.dialogs.DialogSampler``: up to ``rollout.max_turns`` turns, the calls run in a worker process at
    ``tools.timeout_s``), returned with trl's ``env_mask``."""
    tools = resolve_tools(cfg.tools)
    tool_options = {}
    if tools is not None:
        tool_options = {
            "tools": tools,
            "max_turns": cfg.rollout.max_turns,
            "tool_timeout_s": float(cfg.tools.timeout_s),
            "max_result_tokens": cfg.tools.max_result_tokens,
        }
    return TorchRLRolloutFunc(
        tokenizer=tokenizer,
        mode=cfg.rollout.mode,
        max_policy_lag=cfg.rollout.max_policy_lag,
        past_lag_bound=cfg.rollout.past_lag_bound,
        backend=backend_of(cfg),
        workers=cfg.rollout.workers,
        worker_resources=worker_resources(cfg),
        sampler_threads=cfg.rollout.collector_threads,
        weight_sync_every=cfg.rollout.weight_sync_every,
        # The trainer's own dtype: no copy in another (the learner backend samples with the weights it trains).
        sampler_dtype=None if cfg.rollout.sampler_dtype == cfg.dtype else getattr(torch, cfg.rollout.sampler_dtype),
        seed=cfg.seed,
        **tool_options,
    )


def make_eval_callback(cfg: TrlGRPORecipeConfig, trainer, run, tokenizer) -> EvalCallback | None:
    """``eval:``: the data's eval prompts (``eval.num_prompts`` of them), scored by ``eval.accuracy_source``."""
    if cfg.eval.every_n_steps is None:
        return None
    rows = load_prompt_rows(config_view(cfg.data), "eval")
    count = cfg.eval.num_prompts or len(rows)
    rows = PromptRows(rows.prompts[:count], {name: values[:count] for name, values in rows.columns.items()})
    table = make_prompt_table(cfg, rows, tokenizer)
    name = cfg.eval.accuracy_source or next(iter(cfg.reward.functions))
    function = resolve_function(f"reward.functions.{name}.function", cfg.reward.functions[name].function)
    return EvalCallback(
        trainer,
        run.logger,
        table,
        function,
        name=str(name),
        every=cfg.eval.every_n_steps,
        total_steps=trainer.args.max_steps,
        seed=cfg.seed,
    )


def make_replay(cfg: TrlGRPORecipeConfig, tokenizer, *, group_size: int) -> GroupReplay | None:
    """``rollout.replay``: the stored groups that train in tied groups' places, filled first from
    ``rollout.replay.load_from`` (another run's rollouts, checked in ``validate``)."""
    node = cfg.rollout.replay
    if not node.enabled:
        return None
    replay = GroupReplay(capacity=node.capacity, alpha=node.alpha, seed=cfg.seed)
    if node.load_from is not None:
        rows = load_replay_source(cfg, group_size=group_size)
        kept = replay.load_rows(rows, group_size=group_size, pad_token_id=tokenizer.pad_token_id)
        log.info("rollout.replay: %d groups loaded from %s (%d rows)", kept, node.load_from, rows.shape[0])
    return replay


# ---------------------------------------------------------------------------------------------------- recipe


@resolving_tools_once()  # each MCP server of tools: listed once per run
def train(composed: DictConfig) -> dict:
    """Runs (or resumes) trl's GRPO with TorchRL rollouts end to end on the ``composed`` config (Hydra's); returns the
    summary written to ``summary.json``."""
    start = time.perf_counter()
    # Typed settings (resolved; a resumed run's own settings restored; LoRA switched on or off), and the run's record.
    cfg, run_record = validated(composed)
    finished = finished_run_summary(cfg)
    if finished is not None:
        log.info(
            "The run in %s already finished its %d steps: nothing to resume (raise train.max_steps to train further).",
            cfg.output_dir,
            finished["train/steps"],
        )
        return finished
    seed_everything(cfg.seed)
    args = make_grpo_config(cfg)  # trl sets up the processes (under a launcher) first; start_run joins them
    resume_from = latest_trl_checkpoint(args.output_dir) if cfg.resume else None
    # A resume records what it changes against the run's records: both sides as resolved_config.yaml holds them.
    before_config = functools.partial(record_resume_start, run_record) if cfg.resume else None
    # run_record: written as the run's resolved_config.yaml (secrets masked), and the logger's config.
    run = start_run(run_record, resume=cfg.resume, before_config=before_config)
    with run, ray_connection(cfg):  # rollout.backend=ray: the cluster joined (or started) before any model loads
        args.output_dir = run.broadcast(args.output_dir)
        policy = config_view(cfg.model)
        tokenizer = load_tokenizer(policy, padding_side="left")
        model = load_causal_lm(policy, device=args.device, dtype=cfg.dtype)
        table = make_prompt_table(cfg, load_prompt_rows(config_view(cfg.data), "train"), tokenizer)
        reward_funcs, reward_classes = make_reward_funcs(cfg, device=args.device)
        rollout_func = make_rollout_func(cfg, tokenizer)
        oracle = instantiate_function(cfg.data.oracle) if cfg.data.oracle is not None else None
        trainer = make_trainer(
            model,
            tokenizer,
            args,
            make_prompt_stream(table, batch_size=cfg.rollout.prompts_per_draw, seed=cfg.seed),
            reward_funcs=reward_funcs,
            reward_classes=reward_classes,
            rollout_func=rollout_func,
            replay=make_replay(cfg, tokenizer, group_size=args.num_generations),
            peft_config=make_lora_config(cfg.model.lora, task_type="CAUSAL_LM") if cfg.model.lora else None,
        )
        store = make_rollout_store(cfg, run, table, rollout_func, trainer)
        rollout_func.replay_buffer = store  # every scored batch is written there (interop.TorchRLGRPOTrainer)
        # transformers prints trl's whole dict of figures (~1 KB) at every logging step (PrinterCallback, or
        # ProgressCallback under its bar): the recipe's progress line says what a step did, and metrics.csv keeps
        # every figure. progress_bar=true keeps the bar alone.
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        if cfg.progress_bar:
            trainer.add_callback(StepBar)
        guard = make_finite_guard()
        trainer.add_callback(guard)
        trainer.add_callback(make_record_masker(masked_fields(run_record, "train")))  # masked as the record masks them
        metrics = MetricsCallback(
            run.logger, trainer, oracle, total_steps=args.max_steps, every=max(1, args.max_steps // 6)
        )
        trainer.add_callback(metrics)  # every process: it gathers each batch's figures (logged by the main one)
        evaluation = make_eval_callback(cfg, trainer, run, tokenizer)
        if evaluation is not None:
            trainer.add_callback(evaluation)
        log_run_plan(cfg, args, trainer, run)
        train_start = time.perf_counter()
        trainer.train(resume_from_checkpoint=resume_from)
        train_s = time.perf_counter() - train_start
        local_tokens = torch.tensor([store.tokens], device=trainer.accelerator.device)
        tokens = int(trainer.accelerator.gather(local_tokens).sum())
        if guard.reason is not None:
            raise RunStopped(
                f"Training stopped at {guard.reason}: a model trained on would be garbage, so none is saved. Lower "
                f"train.learning_rate (now {args.learning_rate}), then run again."
            )
        run.processes.wait_for_everyone()  # every process's rollouts written before the store is counted
        summary = None
        if run.is_main:
            write_folder_atomically(
                functools.partial(save_model_folder, trainer.model, tokenizer), run.output_dir / "model"
            )
            (run.output_dir / "trainer_log.json").write_text(json.dumps(trainer.state.log_history, indent=1))
            summary = summarize(
                trainer,
                stored_totals(run.output_dir / ROLLOUTS_DIR),
                steps_trained=trainer.state.global_step - (checkpoint_step(resume_from) if resume_from else 0),
                tokens=tokens,
                train_s=train_s,
                wall_s=time.perf_counter() - start,
            )
        summary = run.broadcast(summary)
        return run.finish(summary, closing_message(summary, run.output_dir), warn=bool(barely_learned_line(summary)))


def make_trainer(
    model, tokenizer, args, train_dataset, *, reward_funcs, reward_classes, rollout_func, replay=None, peft_config=None
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
        replay=replay,
        peft_config=peft_config,
    )


def log_run_plan(cfg: TrlGRPORecipeConfig, args, trainer, run) -> None:
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


@hydra.main(version_base="1.3", config_path="../conf", config_name="trl_grpo_torchrl_rollouts")
def main(cfg: DictConfig) -> float:
    # Hydra's composed config: train() checks it; on an interruption, its trainer folder is where the checkpoints are.
    summary = run_recipe(train, cfg, last_checkpoint=_last_checkpoint)
    if PartialState().is_main_process and "train/steps" in summary:  # a failed sweep job says so in its log instead
        print(json.dumps(summary, indent=2))
    # A resumed run reports the metric its own config names (its resolved_config.yaml), not the YAML default's.
    metric = resumed_config(cfg).metric if cfg.resume else cfg.metric
    return summary.get(metric, float("nan"))


def _last_checkpoint(cfg: DictConfig):
    return latest_trl_checkpoint(str(cfg.train.output_dir))


def _trl_names():
    """trl's GRPOConfig fields as this recipe's keys: ``train.<field>``, or the key that sets it here."""
    from trl import GRPOConfig  # trl prints a notice on import: only for a key the recipe does not have

    aliases = trainer_aliases(GRPOConfig)
    return dataclasses.replace(aliases, names={**aliases.names, **GRPO_CONFIG_FIELDS})


if __name__ == "__main__":
    refuse_unknown_overrides(
        sys.argv[1:], TrlGRPORecipeConfig, recipe="trl_grpo_torchrl_rollouts", aliases=_trl_names, renamed=RENAMED
    )
    track_failed_jobs()
    mask_sweep_logs()
    main()
    end_processes()
    exit_if_jobs_failed()
