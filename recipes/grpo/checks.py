"""Every check of a GRPO config that can run before the models load: :func:`validate`, then, once the prompts are
read, :func:`check_prompt_lengths` (tokenizers and model configs only). Each message names the setting, what was found
and what to change.

Dependencies: torch, omegaconf, transformers (``AutoConfig``), and the recipe's own modules.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from transformers import AutoConfig

from recipes.common.checkpoint import (
    MODEL_FOLDER,
    broken_checkpoint_advice,
    check_manifest,
    latest_checkpoint,
    list_checkpoints,
)
from recipes.common.config import ConfigError, check_run_settings, first_items
from recipes.common.lora import validate_policy_lora
from recipes.common.models import check_tokenizer_fits_model, load_tokenizer, validate_model_node
from recipes.common.prompts import PromptTable
from recipes.common.reward_functions import check_reward_functions
from recipes.common.run_folder import check_output_folder, check_writable, input_paths
from recipes.common.schema import checked_config
from recipes.grpo.checkpointing import (
    checkpoint_policy_node,
    checkpoint_root,
    read_metrics_rows,
    resume_changes,
    resumed_config,
)
from recipes.grpo.collector import ROLLOUT_ENVS, check_generation_settings, sampler_settings
from recipes.grpo.distributed import STRATEGIES
from recipes.grpo.evaluation import check_eval_settings
from recipes.grpo.loss import LOSS_TYPES
from recipes.grpo.policy import MIXED_PRECISIONS
from recipes.grpo.report import summary_keys
from recipes.grpo.rewards import REWARD_INPUTS, check_reward_keys, check_reward_sources, reward_prompt_lengths
from recipes.grpo.schema import RENAMED, GRPORecipeConfig

__all__ = ["BACKENDS", "ROLLOUT_MODES", "check_prompt_lengths", "validate"]

BACKENDS = ("auto", "gloo", "nccl")
# transformers' get_scheduler names that take no extra settings.
LR_SCHEDULERS = (
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
)
ROLLOUT_MODES = ("sync", "async")

log = logging.getLogger(__name__)


def validate(cfg: DictConfig) -> DictConfig:
    """Every check that needs nothing loaded; each message says what to change. Returns the config the run trains
    with: resolved once (every later reader, the background collector included, sees the same values), the run's own
    config under a resumed run's command line (``recipes.grpo.checkpointing.resumed_config``), LoRA on or off as the
    command line says (``recipes.common.lora.settle_lora_node``)."""
    if cfg.resume:
        cfg = resumed_config(cfg)
    cfg = checked_config(cfg, GRPORecipeConfig, recipe="grpo_torchrl_rm", renamed=RENAMED)
    _validate_settings(cfg)
    return cfg


def _validate_settings(cfg: DictConfig) -> None:
    _validate_batches(cfg)
    _validate_reporting(cfg)
    _validate_memory(cfg)
    _validate_rollout(cfg.rollout)
    _validate_rewards(cfg)
    check_eval_settings(cfg)
    _validate_algorithm(cfg)
    check_run_settings(
        cfg, lr_key="optimizer.lr", max_grad_norm_key="train.max_grad_norm", batch_size_key="train.mini_batch_size"
    )
    _validate_optimizer(cfg.optimizer)
    _validate_distributed(cfg)
    validate_model_node(cfg.model, key="model", kind="policy")
    if cfg.reward_model is not None:
        validate_model_node(cfg.reward_model, key="reward_model", kind="reward_model")
    _validate_lora(cfg)
    check_tokenizer_fits_model(cfg.model, key="model")
    if cfg.reward_model is not None:
        check_tokenizer_fits_model(cfg.reward_model, key="reward_model")
    if cfg.data.source == "file" and not Path(str(cfg.data.path)).expanduser().exists():
        raise ConfigError(
            f"data.path={str(cfg.data.path)!r}: no such file. Point it at a .jsonl/.json/.parquet/.csv file with a "
            f"{cfg.data.prompt_column!r} column of prompts."
        )
    check_output_folder(cfg.output_dir, resume=cfg.resume, overwrite=cfg.overwrite, inputs=input_paths(cfg))
    if checkpoint_root(cfg).exists():  # a new one is made in the output folder, just checked
        check_writable(
            checkpoint_root(cfg),
            what="the run's checkpoints folder",
            fix="fix its permissions, or run in another folder",
        )
    _validate_resume(cfg)


def _validate_rewards(cfg: DictConfig) -> None:
    """The reward sources: at least one, distinct names, the reward model's input, the keys every source reads; the
    trl functions themselves are checked once the data's columns are known (:func:`check_prompt_lengths`)."""
    check_reward_sources(cfg)
    if cfg.reward_model is not None and cfg.reward.input not in REWARD_INPUTS:
        raise ConfigError(f"reward.input={cfg.reward.input!r}: expected one of {list(REWARD_INPUTS)}.")
    if cfg.reward.functions and cfg.rollout.env == "chat":
        raise ConfigError(
            "reward.functions run on rollout.env=prompt steps (they read each prompt's data row); with "
            "rollout.env=chat use reward.terms (TensorDict modules reading TorchRL's chat layout), or "
            "rollout.env=prompt."
        )
    check_reward_keys(cfg)


def _validate_batches(cfg: DictConfig) -> None:
    group, per_step = cfg.rollout.group_size, cfg.rollout.responses_per_step
    if group < 2:
        raise ConfigError(
            f"rollout.group_size={group}: GRPO normalises each reward against the other responses to the same prompt, "
            "so a group needs at least 2 responses; set rollout.group_size >= 2."
        )
    if per_step < group or per_step % group:
        raise ConfigError(
            f"rollout.responses_per_step={per_step} is not a multiple of rollout.group_size={group}: every prompt "
            f"gets a full group. Use a multiple, e.g. rollout.responses_per_step={max(1, per_step // group) * group}."
        )
    mini = cfg.train.mini_batch_size
    if mini < 1 or per_step % mini:
        raise ConfigError(
            f"train.mini_batch_size={mini} does not divide rollout.responses_per_step={per_step}; each step's "
            "responses are split into equal mini-batches. Pick a divisor (e.g. train.mini_batch_size="
            f"{per_step // 2 if per_step % 2 == 0 else per_step})."
        )
    for key in ("train.steps", "train.epochs_per_step"):
        if OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be >= 1.")
    accumulation = cfg.train.gradient_accumulation_steps
    if (per_step // mini) % accumulation:
        raise ConfigError(
            f"train.gradient_accumulation_steps={accumulation} does not divide the {per_step // mini} mini-batches of "
            f"a step (rollout.responses_per_step={per_step} / train.mini_batch_size={mini}): every optimizer step "
            "accumulates as many. Pick a divisor."
        )


def _validate_algorithm(cfg: DictConfig) -> None:
    """The loss menu, the advantage and the schedule: choices, and what cannot combine, with the reason."""
    loss = cfg.loss
    if loss.type not in LOSS_TYPES:
        raise ConfigError(f"loss.type={loss.type!r}: expected one of {list(LOSS_TYPES)} (trl's loss_type).")
    if OmegaConf.is_list(loss.clip_epsilon):
        if len(loss.clip_epsilon) != 2 or loss.clip_epsilon_high is not None:
            raise ConfigError(
                f"loss.clip_epsilon={list(loss.clip_epsilon)}: a list is TorchRL's (low, high) pair, two numbers, with "
                "loss.clip_epsilon_high null; or give loss.clip_epsilon=<low> loss.clip_epsilon_high=<high>."
            )
    if loss.type == "cispo" and loss.clip_epsilon_high is None and not OmegaConf.is_list(loss.clip_epsilon):
        log.warning(
            "loss.type=cispo clamps the importance ratio itself at loss.clip_epsilon_high, which is null: it takes "
            "loss.clip_epsilon=%s, as trl does, and clamps every ratio below 1. Set loss.clip_epsilon_high (1.28 "
            "learns the tiny task; ScaleRL's 4 collapsed it at step 29).",
            loss.clip_epsilon,
        )
    if loss.sync_ref_model and not loss.kl_to_ref_coeff:
        raise ConfigError(
            "loss.sync_ref_model=true with no KL term (loss.kl_to_ref_coeff is 0 or null): there is no reference to "
            "keep in sync. Set a KL coefficient, or loss.sync_ref_model=false."
        )
    if loss.sync_ref_model and cfg.model.lora is not None:
        raise ConfigError(
            "loss.sync_ref_model=true with model.lora: the reference is the base model with the adapters switched off, "
            "which no update may move (the policy is built on it). Use full fine-tuning (model.lora=null) to sync the "
            "reference, or loss.sync_ref_model=false."
        )
    if cfg.advantage.filter_zero_std_groups and cfg.rollout.mode == "async":
        raise ConfigError(
            "advantage.filter_zero_std_groups=true with rollout.mode=async: the background collector samples one batch "
            "per update under the policy-lag bound, and the extra batches dynamic sampling draws would break that "
            "bound. Use rollout.mode=sync with it."
        )
    warmup = cfg.train.warmup_steps
    if isinstance(warmup, float) and not 0 <= warmup < 1:
        raise ConfigError(f"train.warmup_steps={warmup}: a float is a fraction of the optimizer steps, in [0, 1).")
    if cfg.train.lr_scheduler not in LR_SCHEDULERS:
        raise ConfigError(
            f"train.lr_scheduler={cfg.train.lr_scheduler!r}: expected one of {list(LR_SCHEDULERS)} (transformers' "
            "schedules that need no more settings)."
        )


def _validate_reporting(cfg: DictConfig) -> None:
    every = cfg.checkpoint.every_n_steps
    if every is not None and every < 1:
        raise ConfigError(f"checkpoint.every_n_steps={every} must be >= 1, or null to save only at the end.")
    if cfg.checkpoint.keep_last is not None and cfg.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1, or null to keep all.")
    if cfg.summary.window < 1:
        raise ConfigError(f"summary.window={cfg.summary.window} must be >= 1.")
    if cfg.log_every_n_steps < 1:
        raise ConfigError(f"log_every_n_steps={cfg.log_every_n_steps} must be >= 1.")
    if cfg.samples.every_n_steps is not None and cfg.samples.every_n_steps < 1:
        raise ConfigError(f"samples.every_n_steps={cfg.samples.every_n_steps} must be >= 1, or null for no samples.")
    for key in ("samples.log_count", "samples.print_count"):
        if OmegaConf.select(cfg, key) < 0:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be >= 0.")
    metric = str(cfg.metric)
    known = summary_keys(cfg)
    if metric not in known:
        raise ConfigError(f"metric={metric!r} is not a summary.json entry; use one of {sorted(known)}.")
    if "oracle" in metric and cfg.data.oracle is None:
        raise ConfigError(
            f"metric={metric!r} needs an oracle, but data.oracle is null for data.source={cfg.data.source!r}; "
            "use metric=rollout/reward_mean_last."
        )


# What restore_progress and the schema's optimizer node know how to set: Adam's family.
OPTIMIZERS = ("torch.optim.AdamW", "torch.optim.Adam")


def _validate_optimizer(optimizer: DictConfig) -> None:
    if optimizer._target_ not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer._target_={optimizer._target_!r}: the recipe trains with {list(OPTIMIZERS)} (their lr, betas "
            "and weight_decay are what its config holds and a resume restores); use one of them."
        )
    if optimizer.lr > 1.0:
        raise ConfigError(
            f"optimizer.lr={optimizer.lr}: an Adam step moves every weight by about lr, so above 1 the weights blow "
            "up (past 3.4e38 they overflow float32). Use a learning rate <= 1 (1e-6 to 1e-3 for real models)."
        )


def _validate_lora(cfg: DictConfig) -> None:
    validate_policy_lora(cfg)
    if cfg.checkpoint.save_merged and cfg.model.lora is None:
        raise ConfigError(
            "checkpoint.save_merged=true merges LoRA adapters into a full model, but model.lora is null: the "
            "checkpoint's model folder already is the full model. Drop checkpoint.save_merged, or set model.lora."
        )


def _validate_memory(cfg: DictConfig) -> None:
    precision = cfg.train.mixed_precision
    if precision not in MIXED_PRECISIONS:
        raise ConfigError(f"train.mixed_precision={precision!r}: expected one of {list(MIXED_PRECISIONS)}.")
    if precision == "bf16" and cfg.dtype != "float32":
        raise ConfigError(
            f"train.mixed_precision=bf16 with dtype={cfg.dtype}: bf16 autocast is for float32 weights (the optimizer "
            "then updates float32 master weights while the forward computes in bfloat16). With weights already in "
            f"{cfg.dtype} it changes nothing; use dtype=float32 with train.mixed_precision=bf16, or keep "
            f"dtype={cfg.dtype} with train.mixed_precision=no."
        )
    if not isinstance(cfg.train.gradient_checkpointing, bool):
        raise ConfigError(f"train.gradient_checkpointing={cfg.train.gradient_checkpointing!r}: expected true or false.")


def _validate_resume(cfg: DictConfig) -> None:
    if not isinstance(cfg.resume_allow_changes, ListConfig):
        raise ConfigError(
            f"resume_allow_changes={cfg.resume_allow_changes!r}: expected a list of settings, e.g. "
            "resume_allow_changes=[optimizer.lr]."
        )
    if cfg.resume and latest_checkpoint(checkpoint_root(cfg)) is None:
        raise ConfigError(
            f"resume=true but {checkpoint_root(cfg)} holds no checkpoint. Point the run at the folder of the run to "
            "continue (hydra.run.dir=<that folder>, or output_dir=<that folder> when calling train()), or drop "
            "resume=true to start afresh (with overwrite=true if the folder holds a run killed before its first "
            "checkpoint)."
        )
    if cfg.resume:
        # The weights to resume from, checked as the model paths are: damaged ones fail before anything loads.
        step, checkpoint = list_checkpoints(checkpoint_root(cfg))[-1]
        if (Path(cfg.output_dir) / "metrics.csv").is_file():
            read_metrics_rows(Path(cfg.output_dir) / "metrics.csv")  # a damaged file is named now, not after loading
        damage = check_manifest(checkpoint) or (
            [] if (checkpoint / MODEL_FOLDER).is_dir() else [f"{MODEL_FOLDER}/ is missing"]
        )
        if damage:
            raise ConfigError(
                f"The checkpoint to resume, {checkpoint}, no longer matches what was saved: its files are corrupted "
                f"or truncated, or were changed since ({'; '.join(f'{checkpoint}/{line}' for line in damage)}). "
                f"Resuming from it would train from damaged files. {broken_checkpoint_advice(checkpoint)}"
            )
        if cfg.train.steps < step:
            raise ConfigError(
                f"train.steps={cfg.train.steps} is below the step of the checkpoint to resume ({step}, {checkpoint}): "
                f"the run is past it. Pass train.steps >= {step} to continue it, or start a new run in another folder."
            )
        validate_model_node(checkpoint_policy_node(cfg, checkpoint), key="model", kind="policy")
        refused = {key: change for key, change in resume_changes(cfg).items() if not _allowed(key, cfg)}
        if refused:
            listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in refused.items())
            raise ConfigError(
                f"resume=true with settings that differ from the run being continued ({listed}). A resumed run must "
                "train as the run it continues: pass the same settings, or name the changes you mean "
                f"(resume_allow_changes=[{','.join(refused)}]), or start a new run in another folder."
            )


def check_prompt_lengths(cfg: DictConfig, prompts) -> None:
    """Prompts the models cannot read whole: refused when the policy's positions cannot hold the rendered prompt plus
    ``max_new_tokens``; warned (refused if every prompt) when ``reward.max_length`` cuts the reward model's input
    before the response starts, where every response to the prompt gets the same reward. The trl reward functions
    are checked against the prompts' columns (``recipes.common.reward_functions.check_reward_functions``). Tokenizers
    only, no model.
    """

    tokenizer = load_tokenizer(cfg.model, padding_side="left")
    table = PromptTable(prompts, tokenizer=tokenizer, system_prompt=cfg.rollout.system_prompt)
    lengths = torch.tensor(table.rendered_lengths())
    max_new_tokens = cfg.rollout.generation.max_new_tokens
    config = AutoConfig.from_pretrained(cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None:
        rows = (lengths + max_new_tokens > positions).nonzero().flatten().tolist()
        if rows:
            raise ConfigError(
                f"{len(rows)} of {len(prompts)} prompts (rows {first_items(rows)}) are too long for the policy: "
                f"rendered with its chat template they take up to {int(lengths.max())} tokens, and with "
                f"rollout.generation.max_new_tokens={max_new_tokens} the sequence passes the "
                f"{positions} positions of model.name_or_path={str(cfg.model.name_or_path)!r} "
                "(max_position_embeddings). Shorten or drop those prompts, or lower rollout.generation.max_new_tokens."
            )
    check_reward_functions(cfg, columns=list(table.columns))
    max_length = cfg.reward.max_length
    if max_length is None or cfg.reward_model is None:
        return
    reward_lengths = torch.tensor(reward_prompt_lengths(cfg, table, lengths))
    rows = (reward_lengths >= max_length).nonzero().flatten().tolist()
    if not rows:
        return
    message = (
        f"reward.max_length={max_length} cuts the reward model's input before the response starts for {len(rows)} "
        f"of {len(prompts)} prompts (rows {first_items(rows)}; up to {int(reward_lengths.max())} tokens as the reward "
        f"model reads them, reward.input={cfg.reward.input}): every response to such a prompt gets the same reward, "
        "and its group teaches nothing. Raise reward.max_length (or null: no truncation), or shorten those prompts."
    )
    if len(rows) == len(prompts):
        raise ConfigError(message)
    log.warning(message)


def _validate_rollout(rollout: DictConfig) -> None:
    if rollout.env not in ROLLOUT_ENVS:
        raise ConfigError(f"rollout.env={rollout.env!r}: expected one of {list(ROLLOUT_ENVS)}.")
    if rollout.mode not in ROLLOUT_MODES:
        raise ConfigError(f"rollout.mode={rollout.mode!r}: expected one of {list(ROLLOUT_MODES)}.")
    if rollout.mode == "async" and rollout.env != "prompt":
        raise ConfigError(
            f"rollout.mode=async runs the collector of rollout.env=prompt in a background process; rollout.env="
            f"{rollout.env} collects in the learner's process only. Use rollout.env=prompt, or rollout.mode=sync."
        )
    if rollout.max_policy_lag < 0:
        raise ConfigError(f"rollout.max_policy_lag={rollout.max_policy_lag} must be >= 0.")
    if rollout.collector_threads < 1:
        raise ConfigError(f"rollout.collector_threads={rollout.collector_threads} must be >= 1.")
    generation = rollout.generation
    check_generation_settings(generation, env=rollout.env)
    if generation.max_new_tokens < 1:
        raise ConfigError(f"rollout.generation.max_new_tokens={generation.max_new_tokens} must be >= 1.")
    if not generation.do_sample:
        raise ConfigError(
            "rollout.generation.do_sample=false: greedy decoding gives every response to a prompt the same text and "
            "reward, so GRPO's group-normalised advantages are all 0 and nothing is learned. Sample "
            "(rollout.generation.do_sample=true, with a temperature > 0)."
        )
    if generation.temperature <= 0:
        raise ConfigError(
            f"rollout.generation.temperature={generation.temperature} must be > 0 when sampling; GRPO needs diverse "
            "responses within a group."
        )
    if rollout.env == "prompt":
        sampler_settings(generation)


def _validate_distributed(cfg: DictConfig) -> None:
    backend = cfg.distributed.backend
    if backend not in BACKENDS:
        raise ConfigError(f"distributed.backend={backend!r}: expected one of {list(BACKENDS)}.")
    on_cuda = str(cfg.device).startswith("cuda")
    if backend == "nccl" and not on_cuda:
        raise ConfigError(f"distributed.backend=nccl needs device=cuda (got device={cfg.device!r}); use gloo or auto.")
    _validate_strategy(cfg)
    if "WORLD_SIZE" not in os.environ or not on_cuda:
        return
    local_rank, world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > 1 and str(cfg.device) != "cuda":
        raise ConfigError(
            f"device={cfg.device!r} under torchrun with {world_size} processes: use device=cuda, each process then "
            "takes cuda:<LOCAL_RANK>."
        )
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} CUDA devices; start at most that "
            "many processes per node (torchrun --nproc_per_node)."
        )


def _validate_strategy(cfg: DictConfig) -> None:
    strategy = cfg.distributed.strategy
    if strategy not in STRATEGIES:
        raise ConfigError(f"distributed.strategy={strategy!r}: expected one of {list(STRATEGIES)}.")
    if strategy != "fsdp":
        return
    # Outside torchrun (or with one process) there is nothing to shard over: the run trains as with ddp.
    if cfg.rollout.mode == "async":
        raise ConfigError(
            "distributed.strategy=fsdp with rollout.mode=async: the background collector samples with a whole copy "
            "of the policy, refreshed from the learner's weights, which sharding splits between the processes. Use "
            "rollout.mode=sync with fsdp, or distributed.strategy=ddp for async collection."
        )
    if cfg.rollout.env == "chat":
        raise ConfigError(
            "distributed.strategy=fsdp with rollout.env=chat: TorchRL's TransformersWrapper calls generate(), which "
            "stops decoding per process when its rows are done, while a sharded policy needs every process in every "
            "forward pass. Use rollout.env=prompt (its sampler keeps the processes in step) with fsdp, or "
            "distributed.strategy=ddp with rollout.env=chat."
        )


def _allowed(key: str, cfg: DictConfig) -> bool:
    return any(key == name or key.startswith(f"{name}.") for name in cfg.resume_allow_changes)
