"""Reward-model training from a TorchRL preference buffer with trl's ``RewardTrainer``, end to end.

1. Pairs. ``data=synthetic``: the policy (``model=``, TorchRL's ``TransformersWrapper``) samples several responses per
   prompt in single-turn ``ChatEnv`` rollouts (``recipes.common.chat``, as the GRPO recipe's ``rollout.env=chat``
   does), and the labeler (``labeler._target_``, the synthetic oracle by default) turns them into chosen/rejected
   pairs, dropping ties.
   ``data=file|hf``: pairs in trl's preference formats (explicit or implicit prompt, text or conversational).
   Held-out pairs (eval prompts, the eval split or a held-out fraction) never enter the buffer.
2. Buffer. The pairs are tokenized once for the reward model, with trl's own convention (trl then skips its
   tokenization), into a TorchRL ``ReplayBuffer``: ``buffer=lazy_tensor`` in memory, or ``buffer=memmap`` on disk
   next to the labelled text, which a later run reuses with ``buffer.load_from`` (no generation, no labelling): it
   trains from the stored token ids when its reward model's tokenizer wrote them, from the re-tokenized text
   otherwise; a cut or damaged folder is refused. Pairs whose chosen and rejected are identical are dropped.
   How pairs are made, cleaned and tokenized: ``recipes.reward.pairs``; the folder: ``recipes.reward.pair_store``;
   the buffer and trl's streams: ``recipes.reward.buffer``.
3. Training. ``RewardTrainer`` (``RewardConfig`` from ``train:``) reads the buffer through
   ``interop.TorchRLBufferDataset(...).as_hf_dataset()``: one draw without replacement per epoch.
4. Evaluation of the saved model, reloaded with ``from_pretrained`` and scored through
   ``interop.HFRewardModelWrapper(tokenizer=...)`` as the GRPO recipe scores: pairwise accuracy and margin on the
   held-out pairs and, on the synthetic task, the Spearman correlation of its scores with the oracle's. Like
   training, it keeps to sequences of at most ``train.max_length`` tokens (trl drops longer pairs)
   (``recipes.reward.evaluation``).

Several processes (``accelerate launch`` / ``torchrun``): the main process makes the labelled pairs and hands them to
the others; every process fills the same buffer, whose sampler draws from its own generator seeded with ``seed``, so
all processes see one stream of pairs and accelerate gives each its own slice of every step (trl reads iterable
datasets with ``dispatch_batches=False``): no pair twice in an optimizer step, which takes
``per_device_train_batch_size * gradient_accumulation_steps * processes`` pairs. Only the main process writes the
buffer folder, the model, metrics and ``summary.json``, and evaluates.

    python recipes/reward_trainer_from_buffer.py
    python recipes/reward_trainer_from_buffer.py -m seed=0,1,2 train.learning_rate=1e-3,3e-3
    accelerate launch --multi_gpu --num_processes 2 recipes/reward_trainer_from_buffer.py hydra.run.dir=outputs/rm2
    accelerate launch --use_fsdp --fsdp_version 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --num_processes 2 \
        recipes/reward_trainer_from_buffer.py device=cuda

With ``--use_fsdp`` accelerate shards the model (FSDP2, GPUs only: refused on CPU, where accelerate would silently
keep a whole copy per process); every process sends its shards for the save, and the main process writes them whole.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import sys
import time
from pathlib import Path

import hydra
from accelerate import PartialState
from omegaconf import DictConfig
from transformers import AutoTokenizer, TrainerCallback

from recipes.common.callbacks import make_finite_guard, make_record_masker
from recipes.common.checkpoint import save_model_folder, write_folder_atomically
from recipes.common.config import ConfigError, RunStopped, hand_token_to_environment, masked_fields
from recipes.common.dotted_paths import instantiate_function
from recipes.common.lora import make_lora_config
from recipes.common.metrics import MetricLogger, peak_device_memory
from recipes.common.models import load_reward_model, load_tokenizer
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
from recipes.common.schema import config_view, refuse_unknown_overrides, trainer_aliases
from recipes.common.sharding import gather_full_model_state, is_sharded
from recipes.reward.buffer import make_eval_dataset, make_training_stream
from recipes.reward.checks import kept_records, validate, validated
from recipes.reward.evaluation import evaluate
from recipes.reward.pair_store import EVAL_PAIRS_FILE, load_labelled_pairs, write_jsonl
from recipes.reward.pairs import (
    LabelledPairs,
    limit_eval_to_max_length,
    load_sampling_policy,
    pairs_from_dataset,
    pairs_from_policy,
)
from recipes.reward.schema import RewardRecipeConfig, reward_trainer_view

__all__ = ["train", "validate"]

# trl is imported where the trainer is made: it prints a notice on import and takes a second, which `--help` and a
# config refused by validate() need not wait for (the same rule as recipes.common.data's datasets and
# recipes.common.lora's peft).

log = logging.getLogger(__name__)

# The run reads its typed settings (``cfg``: a ``RewardRecipeConfig``, built by ``validate``), never the composed
# DictConfig. The resolved DictConfig stays beside them as ``run_record``, where a DictConfig is the point: the run's
# record (``start_run`` writes resolved_config.yaml and the logger's config, secrets masked; ``masked_fields``).
# ``recipes.common.models`` takes model nodes as DictConfigs (it merges them with OmegaConf): ``config_view``.


# ---------------------------------------------------------------------------------------------------- pairs


def make_labelled_pairs(cfg: RewardRecipeConfig) -> LabelledPairs:
    """Generated and labelled pairs (``data=synthetic``) or pairs read from a file / HF dataset."""
    if cfg.data.source == "synthetic":
        policy, tokenizer = load_sampling_policy(
            cfg.model, generate_kwargs=cfg.generation.generate_kwargs, device=cfg.device, dtype=cfg.dtype
        )
        return pairs_from_policy(
            policy,
            tokenizer,
            cfg.data,
            labeler=hydra.utils.instantiate(cfg.labeler),
            oracle=instantiate_function(cfg.data.oracle) if cfg.data.oracle is not None else None,
            responses_per_prompt=cfg.generation.responses_per_prompt,
            prompts_per_batch=cfg.generation.prompts_per_batch,
            seed=cfg.seed,
        )
    return pairs_from_dataset(cfg.data, holdout_fraction=cfg.eval.holdout_fraction, seed=cfg.seed)


def make_or_load_labelled_pairs(cfg: RewardRecipeConfig, tokenizer) -> LabelledPairs:
    """The run's labelled pairs: loaded from ``buffer.load_from`` (its stored token ids reused when ``tokenizer``
    wrote them), or made from ``data=``."""
    if cfg.buffer.load_from is not None:
        return load_labelled_pairs(cfg.buffer.load_from, tokenizer=tokenizer, pair_keys=cfg.buffer.pair_keys)
    return make_labelled_pairs(cfg)


def make_data(cfg: RewardRecipeConfig, tokenizer, run: Run) -> tuple[LabelledPairs, object, dict]:
    """The run's labelled pairs, the training stream over its buffer, and the facts the summary reports about them.

    The returned pairs hold the held-out pairs this run evaluates: those trl would train on (the buffer folder keeps
    every held-out pair, as a later run may allow longer ones).
    """
    main_process = run.is_main
    # The main process makes (or loads) the pairs, the others receive them (waiting up to train.ddp_timeout seconds):
    # processes generating for themselves would agree only as far as their devices compute alike. A failure on the
    # main process ends the launch (torchrun stops the waiting processes).
    labelled = run.broadcast(make_or_load_labelled_pairs(cfg, tokenizer) if main_process else None)
    if cfg.margin_in_loss and not labelled.has_margin:
        raise ConfigError("margin_in_loss=true, but the pairs carry no margin; set margin_in_loss=false.")
    if not labelled.eval:
        raise ConfigError("No held-out pairs to evaluate on: add eval prompts, an eval split or more pairs.")
    train_dataset, facts = make_training_stream(
        cfg, labelled, tokenizer, num_processes=run.processes.num_processes, persist=main_process
    )
    max_length = reward_trainer_view(cfg.train).max_length
    labelled, eval_facts = limit_eval_to_max_length(labelled, tokenizer, max_length)
    return labelled, train_dataset, {**labelled.facts, **facts, **eval_facts}


# ---------------------------------------------------------------------------------------------------- training


def make_reward_config(cfg: RewardRecipeConfig):
    """``trl.RewardConfig`` from ``train:``, with the device this run decides.

    trl reports to nothing itself: its logs go through the recipe's own logger (``logger=``), csv or wandb, as the
    GRPO recipe's do (:func:`make_metrics_callback`)."""
    args = hydra.utils.instantiate(
        cfg.train,
        _convert_="all",  # trl/transformers check for plain lists and dicts
        use_cpu=cfg.device == "cpu",
        report_to="none",
    )
    hand_token_to_environment(args)  # never pickled into trl's checkpoints
    return args


def make_metrics_callback(logger: MetricLogger, *, total_steps: int):
    """A TrainerCallback writing trl's logs to ``logger``: its training logs as ``train/...`` metrics and its
    periodic evaluations (``train.eval_strategy=steps``) as ``eval/...``, one row per log, and a progress line to the
    run's log (every ``train.logging_steps`` steps). The final evaluation goes to ``summary.json`` (and the wandb run's
    summary); everything trl logged is also in ``trainer_log.json``.
    """

    def numbers(logs: dict) -> dict:
        return {k: v for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    class MetricLoggerCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs:
                logger.log({f"train/{name}": value for name, value in numbers(logs).items()}, step=state.global_step)
                shown = [f"{name} {logs[name]:.4g}" for name in ("loss", "accuracy", "margin") if name in logs]
                log.info("Step %d/%d: %s", state.global_step, total_steps, ", ".join(shown))
            elif "eval_loss" in logs:
                evaluated = {f"eval/{name.removeprefix('eval_')}": value for name, value in numbers(logs).items()}
                logger.log(evaluated, step=state.global_step)

    return MetricLoggerCallback()


def log_run_plan(cfg: RewardRecipeConfig, args, facts: dict, *, num_eval_pairs: int, output_dir: Path) -> None:
    """Says in the run's log what is about to train, on what, and where the run writes."""
    log.info(
        "Reward model training: %s trained from a TorchRL buffer (%s storage) of %d preference pairs (data=%s), "
        "%d steps of %d pairs, lr %s, seed %d, %s %s; %d held-out pairs; run folder %s",
        cfg.reward_model.name_or_path,
        cfg.buffer.storage,
        facts["train/num_pairs"],
        cfg.data.source,
        args.max_steps,
        facts["train/pairs_per_step"],
        args.learning_rate,
        cfg.seed,
        cfg.device,
        cfg.dtype,
        num_eval_pairs,
        output_dir,
    )


def make_trainer(
    model, tokenizer, args, train_dataset, labelled: LabelledPairs, *, with_margin: bool, callbacks, lora=None
):
    """trl's ``RewardTrainer`` (with its own collator) reading the buffer's stream; with ``train.eval_strategy`` other
    than "no" it also evaluates the held-out pairs as it trains. ``lora`` (``reward_model.lora``): trl wraps the model
    in LoRA adapters, the score head (new, or the base's) trained in full beside them."""
    from trl import RewardTrainer

    eval_dataset = None
    if args.eval_strategy != "no":
        eval_dataset = make_eval_dataset(tokenizer, labelled, with_margin=with_margin)
    return RewardTrainer(
        model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=None if lora is None else make_lora_config(lora, task_type="SEQ_CLS", modules_to_save=["score"]),
    )


def fit(trainer, *, facts: dict, max_length: int | None) -> float:
    """Trains and returns the seconds it took; a run that made no optimizer step fails, saying why."""
    train_start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - train_start
    if trainer.state.global_step == 0:
        raise RuntimeError(
            f"RewardTrainer made no optimizer step: {facts['train/pairs_over_max_length']} of "
            f"{facts['train/num_pairs']} training pairs are longer than train.max_length={max_length} "
            "tokens, and trl drops such pairs. Raise train.max_length (or shorten the data)."
        )
    return train_s


def gather_trained_weights(model) -> dict | None:
    """The whole weights of a model that accelerate's FSDP2 sharded (``accelerate launch --use_fsdp --fsdp_version
    2``), gathered onto the main process's CPU for its ``save_pretrained``; ``None`` for a model every process holds
    whole. Every process must call it: each sends its shards."""
    return gather_full_model_state(model) if is_sharded(model) else None


def save_and_evaluate(
    trainer, tokenizer, labelled: LabelledPairs, cfg: RewardRecipeConfig, output_dir: Path, *, device, full_state=None
) -> dict[str, float]:
    """Writes trl's log history and the model folder (a LoRA adapter folder with ``reward_model.lora``), then
    evaluates the saved model on the held-out pairs. ``full_state``: the whole weights of a model sharded by
    accelerate's FSDP, gathered (:func:`gather_trained_weights`), which the folder holds in place of the shards."""
    (output_dir / "trainer_log.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    model_dir = write_folder_atomically(
        functools.partial(save_model_folder, trainer.model, tokenizer, state_dict=full_state), output_dir / "model"
    )
    # Measure what ships: the saved folder, loaded as a user (or the GRPO recipe) loads it.
    saved_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    node = dataclasses.replace(cfg.reward_model, name_or_path=str(model_dir), tokenizer_name_or_path=None)
    saved = load_reward_model(
        config_view(node), device=device, dtype="float32", pad_token_id=saved_tokenizer.pad_token_id
    )
    return evaluate(saved, saved_tokenizer, labelled, cfg.eval)


# ---------------------------------------------------------------------------------------------------- recipe


def train(composed: DictConfig) -> dict:
    """Runs the preference stage end to end on the ``composed`` config (Hydra's) and returns the summary written to
    ``<output_dir>/summary.json``.

    Under ``accelerate launch`` / ``torchrun`` every process calls it and gets the same summary back.
    """
    start = time.perf_counter()
    cfg, run_record = validated(composed)  # typed settings (resolved, LoRA switched on or off), and the run's record
    seed_everything(cfg.seed)
    # trl's config sets up the processes first (under a launcher: torch.distributed with its ddp_timeout, gloo on CPU,
    # nccl on GPU); start_run joins them.
    args = make_reward_config(cfg)
    run = start_run(
        run_record,  # written as the run's resolved_config.yaml (secrets masked), and the logger's config
        tidy=[Path(cfg.buffer.path).parent] if cfg.buffer.path else [],
        keep=kept_records(cfg),  # a buffer this run reuses, if in the folder
    )
    with run:  # the logger closes however the run ends: Hydra multirun jobs share this process
        # Every process writes where the main process does (trl's RNG states in checkpoints).
        args.output_dir = run.broadcast(args.output_dir)
        tokenizer = load_tokenizer(cfg.reward_model, padding_side="right")
        labelled, train_dataset, facts = make_data(cfg, tokenizer, run)
        if run.is_main:
            write_jsonl(run.output_dir / EVAL_PAIRS_FILE, labelled.eval)  # the held-out pairs this run evaluates
            log_run_plan(cfg, args, facts, num_eval_pairs=len(labelled.eval), output_dir=run.output_dir)
        pairs_s = time.perf_counter() - start

        # args.device: this process's own device (cuda:<local rank> under a launcher).
        # The model trained into a reward model: a classifier's base or a causal LM, whose score head may be new.
        model = load_reward_model(
            config_view(cfg.reward_model),
            device=args.device,
            dtype=cfg.dtype,
            pad_token_id=tokenizer.pad_token_id,
            trained=False,
        )
        guard = make_finite_guard()
        callbacks = [
            guard,
            make_record_masker(masked_fields(run_record, "train")),  # masked as the record masks them
            *([make_metrics_callback(run.logger, total_steps=args.max_steps)] if run.is_main else []),
        ]
        trainer = make_trainer(
            model,
            tokenizer,
            args,
            train_dataset,
            labelled,
            with_margin=cfg.margin_in_loss,
            callbacks=callbacks,
            lora=cfg.reward_model.lora,
        )
        train_s = fit(trainer, facts=facts, max_length=args.max_length)
        if guard.reason is not None:
            raise RunStopped(
                f"Training stopped at {guard.reason}: a model trained on would be garbage, so none is saved. Lower "
                f"train.learning_rate (now {args.learning_rate}), or check the pairs, then run again."
            )
        full_state = gather_trained_weights(trainer.model)  # every process takes part; None unless sharded
        summary = None
        if run.is_main:
            metrics = save_and_evaluate(
                trainer, tokenizer, labelled, cfg, run.output_dir, device=args.device, full_state=full_state
            )
            summary = summarize(
                trainer, metrics, facts, pairs_s=pairs_s, train_s=train_s, wall_time_s=time.perf_counter() - start
            )
        summary = run.broadcast(summary)  # the others wait while the main process saves and evaluates
        message = closing_message(summary, run.output_dir, learning_rate=args.learning_rate)
        return run.finish(summary, message, warn=not learned_enough(summary))


def summarize(trainer, metrics: dict, facts: dict, *, pairs_s: float, train_s: float, wall_time_s: float) -> dict:
    """The held-out figures, the first and last training losses, the facts about the data, and the times."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry] or [float("nan")]
    return {
        **metrics,
        "train/steps": trainer.state.global_step,
        "train/loss_first": losses[0],
        "train/loss_last": losses[-1],
        **facts,
        "perf/steps_per_s": trainer.state.global_step / train_s,
        "perf/pairs_s": pairs_s,
        "perf/train_s": train_s,
        "perf/wall_time_s": wall_time_s,
        **peak_device_memory(trainer.args.device),
    }


# Pairwise accuracy of a reward model that learned nothing: it ranks a held-out pair right half of the time.
CHANCE_ACCURACY = 0.5
# On the synthetic task, a model whose scores follow the oracle less than this (Spearman) is not announced as ready
# even above chance accuracy: the default run reaches 0.95, and a model near 0 ranks pairs by something else than what
# GRPO's oracle measures (the attention-only LoRA command of docs/lora.md: accuracy 0.69, Spearman -0.05).
MIN_ORACLE_SPEARMAN = 0.5


def learned_enough(summary: dict) -> bool:
    """Above chance on held-out pairs (NaN: no) and, where the task has an oracle, scoring as the oracle does."""
    spearman = summary.get("eval/spearman", math.nan)
    follows_the_oracle = math.isnan(spearman) or spearman >= MIN_ORACLE_SPEARMAN  # NaN: no oracle here
    return summary["eval/accuracy"] > CHANCE_ACCURACY and follows_the_oracle


def closing_message(summary: dict, output_dir: Path, *, learning_rate: float) -> str:
    """Where the model is and its held-out figures; the GRPO command that uses it only when it ranks held-out pairs
    better than chance (a model that learned nothing is never announced as ready)."""
    spearman = f", Spearman vs the oracle {summary['eval/spearman']:.3f}" if "eval/spearman" in summary else ""
    figures = (
        f"held-out accuracy {summary['eval/accuracy']:.3f}, margin {summary['eval/margin_mean']:.3f}{spearman}; "
        f"saved to {output_dir / 'model'}"
    )
    if not summary["eval/accuracy"] > CHANCE_ACCURACY:  # NaN too
        return (
            f"The reward model learned nothing: {figures}. Its held-out accuracy is not above chance "
            f"({CHANCE_ACCURACY}), so it is not ready for GRPO. Lower train.learning_rate (now {learning_rate}), train "
            "longer, or check the pairs (a labeler that prefers at random teaches nothing)."
        )
    if not learned_enough(summary):
        return (
            f"The reward model barely learned the task: {figures}. Its scores follow the oracle with a Spearman "
            f"below {MIN_ORACLE_SPEARMAN} (the default run: 0.95), so it is not ready for GRPO. Train more of the "
            f"model (full fine-tuning: reward_model.lora=null; the tiny model's LoRA adapters do not learn the task, "
            f"docs/lora.md), change train.learning_rate (now {learning_rate}) or train longer."
        )
    return (
        f"Reward model trained: {figures}. Use it in GRPO: python recipes/grpo_torchrl_rm.py "
        f"reward_model.name_or_path={output_dir / 'model'}"
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="reward_trainer_from_buffer")
def main(cfg: DictConfig) -> float:
    # accelerate says so at every evaluation of a stream (the buffer is one, on purpose): noise in the run's log.
    logging.getLogger("accelerate.accelerator").addFilter(
        lambda record: "The used dataset had no length" not in record.getMessage()
    )
    summary = run_recipe(train, cfg)
    if PartialState().is_main_process and "train/steps" in summary:  # a failed sweep job says so in its log instead
        print(json.dumps(summary, indent=2))
    # Hydra's composed config: train() checked it, and metric names the summary's figure a sweeper optimises.
    return summary[cfg.metric]


def _trl_names():
    from trl import RewardConfig  # trl prints a notice on import: only for a key the recipe does not have

    return trainer_aliases(RewardConfig)


if __name__ == "__main__":
    refuse_unknown_overrides(sys.argv[1:], RewardRecipeConfig, recipe="reward_trainer_from_buffer", aliases=_trl_names)
    track_failed_jobs()
    mask_sweep_logs()
    main()
    end_processes()
    exit_if_jobs_failed()
