"""GRPO built from TorchRL components, rewarded by a Hugging Face reward model through ``interop``.

    python recipes/grpo_torchrl_rm.py                                     # tiny policy + tiny RM, ~15 s on 2 CPUs
    python recipes/grpo_torchrl_rm.py -m optimizer.lr=1e-3,2e-3,4e-3      # a sweep: main() returns cfg.metric
    torchrun --standalone --nproc_per_node 2 recipes/grpo_torchrl_rm.py hydra.run.dir=outputs/ddp  # data-parallel

Each step (``rollout.env=prompt``, the default): a ``PromptEnv`` draws ``responses_per_step / group_size`` prompts as
one dense left-padded batch, each repeated ``group_size`` times; the ``SamplingPolicy`` samples every response in one
decoding loop and records the sampled tokens' log-probs (the behaviour policy's, the old log-probs of the loss); the
env's ``interop.RewardModelTransform`` scores each response with the reward model (conversations rendered with its
own tokenizer and chat template); a TorchRL ``Collector`` drives env and policy and hands over a dense ``[B, T]``
batch. The learner normalises the rewards within each prompt's group (``MCAdvantage``), scores the frozen
reference's log-probs over the response positions only, fills a ``ReplayBuffer`` and updates the policy with
``GRPOLoss`` (its log-probs too over the response positions only) and AdamW over mini-batches. With
``rollout.mode=async`` the collector runs in a child process and generates step ``t + 1`` while the learner trains
on step ``t`` (at most ``rollout.max_policy_lag`` updates behind; the loss's importance ratio corrects for it).
``rollout.env=chat`` collects with TorchRL's ``ChatEnv`` + ``TransformersWrapper`` + ``LLMCollector`` instead (for
multi-turn and tool transforms), padded into the same batches. Metrics go to the configured logger, checkpoints to
``<output_dir>/checkpoints``, the final figures to ``summary.json``.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) every process joins one process group (gloo on CPU,
nccl on CUDA, each process on ``cuda:<LOCAL_RANK>``) and collects its own ``responses_per_step`` responses: the
prompt stream is dealt out between the processes and each samples with its own seed (``seed + rank``). The loss runs
through a ``DistributedDataParallel`` wrapper of the policy's log-prob scorer, so every update applies the gradients
averaged over all processes and the weights stay identical everywhere; metrics are averaged over the processes before
rank 0 alone logs them, saves checkpoints and writes ``summary.json``. Every process gets the same
``hydra.run.dir`` (rank 0's output folder is used by all, but pass one explicitly so that Hydra does not create a
folder per process).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement
from tqdm.auto import tqdm
from transformers import AutoConfig

from recipes.common.collection import REWARD_INPUTS, PrepareBatch, check_reward_keys, make_collector
from recipes.common.config import ConfigError, check_run_settings, first_items, run_config
from recipes.common.data import load_prompts
from recipes.common.distributed import (
    STRATEGIES,
    check_ranks_in_sync,
    make_policy_scorer,
    mean_over_processes,
    pool_over_processes,
)
from recipes.common.log_probs import ResponseLogProbs
from recipes.common.lora import AdapterDisabledLogProbs, load_policy, trainable_parameters, validate_lora_node
from recipes.common.losses import ResponseGRPOLoss
from recipes.common.memory import MIXED_PRECISIONS, enable_activation_checkpointing, update_forward
from recipes.common.models import load_causal_lm, load_reward_model, load_tokenizer, validate_model_node
from recipes.common.prompt_env import PromptTable
from recipes.common.resume import (
    MODEL_FOLDER,
    capture_rng_state,
    config_changes,
    latest_checkpoint,
    list_checkpoints,
    load_training_state,
    record_resume,
    restore_rng_state,
    save_checkpoint,
    truncate_metrics_csv,
)
from recipes.common.rollout import check_generation_settings
from recipes.common.run import Run, end_processes, run_recipe, seed_everything, start_run
from recipes.common.run_folder import check_output_folder
from recipes.common.sampling import SamplingSettings
from recipes.common.sharding import (
    ShardedResponseLogProbs,
    gather_full_state,
    is_sharded,
    load_full_optimizer_state,
    shard_frozen_model,
)

BACKENDS = ("auto", "gloo", "nccl")
ROLLOUT_ENVS = ("prompt", "chat")
ROLLOUT_MODES = ("sync", "async")
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
SUMMARY_SERIES = ("rollout/reward_mean", "rollout/oracle_mean", "train/kl_to_ref")
SUMMARY_KEYS = (*RUN_FIGURES, *(f"{name}_{end}" for name in SUMMARY_SERIES for end in ("first", "last")))
# Settings a resumed run may change freely: where and how it runs and reports, not what it trains. Any other change
# (group size, batch sizes, models, data, learning rate...) must be named in resume_allow_changes.
RESUME_FREE_KEYS = (
    "resume",
    "overwrite",
    "resume_allow_changes",
    "output_dir",
    "logger",
    "progress_bar",
    "log_every_n_steps",
    "samples",
    "num_threads",
    "train.steps",
    "train.gradient_checkpointing",  # recomputes the same activations: the same update
    "checkpoint",
    "summary",
    "metric",
    "rollout.collector_threads",
    "rollout.log_prob_micro_batch_size",
    "reward.micro_batch_size",
)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------- validation


def _checkpoint_root(cfg: DictConfig) -> Path:
    return Path(cfg.output_dir) / "checkpoints"


def validate(cfg: DictConfig) -> None:
    """Cross-field checks that need nothing loaded; each message says what to change."""
    _validate_batches(cfg)
    _validate_reporting(cfg)
    _validate_memory(cfg)
    _validate_rollout(cfg.rollout)
    if cfg.reward.input not in REWARD_INPUTS:
        raise ConfigError(f"reward.input={cfg.reward.input!r}: expected one of {list(REWARD_INPUTS)}.")
    check_reward_keys(cfg)
    if cfg.loss.aggregation not in ("token_mean", "prompt_mean"):
        raise ConfigError(f"loss.aggregation={cfg.loss.aggregation!r}: expected 'token_mean' or 'prompt_mean'.")
    if cfg.loss.kl_to_ref_coeff is not None and cfg.loss.kl_to_ref_coeff < 0:
        raise ConfigError(f"loss.kl_to_ref_coeff={cfg.loss.kl_to_ref_coeff} must be >= 0 (or null: no reference).")
    check_run_settings(
        cfg, lr_key="optimizer.lr", max_grad_norm_key="train.max_grad_norm", batch_size_key="train.mini_batch_size"
    )
    _validate_distributed(cfg)
    validate_model_node(cfg.model, key="model", kind="policy")
    validate_model_node(cfg.reward_model, key="reward_model", kind="reward_model")
    _validate_lora(cfg)
    if cfg.data.source == "file" and not Path(str(cfg.data.path)).expanduser().exists():
        raise ConfigError(
            f"data.path={str(cfg.data.path)!r}: no such file. Point it at a .jsonl/.json/.parquet/.csv file with a "
            f"{cfg.data.prompt_column!r} column of prompts."
        )
    check_output_folder(cfg.output_dir, resume=cfg.resume, overwrite=cfg.overwrite)
    _validate_resume(cfg)


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
    if metric not in SUMMARY_KEYS:
        raise ConfigError(f"metric={metric!r} is not a summary.json entry; use one of {sorted(SUMMARY_KEYS)}.")
    if "oracle" in metric and cfg.data.oracle is None:
        raise ConfigError(
            f"metric={metric!r} needs an oracle, but data.oracle is null for data.source={cfg.data.source!r}; "
            "use metric=rollout/reward_mean_last."
        )


def _validate_lora(cfg: DictConfig) -> None:
    validate_lora_node(cfg.model.lora, key="model.lora")
    if cfg.reward_model.lora is not None:
        raise ConfigError(
            "reward_model.lora is set, but GRPO's reward model is frozen: it trains no adapters. Drop it (to score "
            "with a LoRA reward model, point reward_model.name_or_path at the adapter folder the reward recipe saved)."
        )
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
    if cfg.resume and latest_checkpoint(_checkpoint_root(cfg)) is None:
        raise ConfigError(
            f"resume=true but {_checkpoint_root(cfg)} holds no checkpoint. Point the run at the folder of the run to "
            "continue (hydra.run.dir=<that folder>, or output_dir=<that folder> when calling train()), or drop "
            "resume=true to start afresh (with overwrite=true if the folder holds a run killed before its first "
            "checkpoint)."
        )
    if cfg.resume:
        # The weights to resume from, checked as the model paths are: damaged ones fail before anything loads.
        checkpoint = latest_checkpoint(_checkpoint_root(cfg))
        validate_model_node(checkpoint_policy_node(cfg, checkpoint), key="model", kind="policy")
        refused = {key: change for key, change in resume_changes(cfg).items() if not _allowed(key, cfg)}
        if refused:
            listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in refused.items())
            raise ConfigError(
                f"resume=true with settings that differ from the run being continued ({listed}). A resumed run must "
                "train as the run it continues: pass the same settings, or name the changes you mean "
                f"(resume_allow_changes=[{','.join(refused)}]), or start a new run in another folder."
            )


def check_prompt_lengths(cfg: DictConfig, prompts: list) -> None:
    """Prompts the models cannot read whole: refused when the policy's positions cannot hold the rendered prompt plus
    ``max_new_tokens``; warned (refused if every prompt) when ``reward.max_length`` cuts the reward model's input
    before the response starts, where every response to the prompt gets the same reward. Tokenizers only, no model.
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
    max_length = cfg.reward.max_length
    if max_length is None:
        return
    reward_lengths = torch.tensor(_reward_prompt_lengths(cfg, table, lengths))
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


def _reward_prompt_lengths(cfg: DictConfig, table: PromptTable, policy_lengths: torch.Tensor) -> list[int]:
    """Each prompt's length as the reward model reads it (``reward.input``): the prefix before any response token."""
    if cfg.reward.input == "tokens":  # the policy's own token ids
        return policy_lengths.tolist()
    reward_tokenizer = load_tokenizer(cfg.reward_model, padding_side="right")
    if cfg.reward.input == "text":  # the policy's rendered prompt, re-tokenized
        texts = [table.rendered(index)[0] for index in range(len(table))]
        return [len(ids) for ids in reward_tokenizer(texts)["input_ids"]]
    rendered = reward_tokenizer.apply_chat_template(table.conversations, tokenize=True, return_dict=True)
    return [len(ids) for ids in rendered["input_ids"]]


def resume_changes(cfg: DictConfig) -> dict:
    """The settings of ``cfg`` that differ from the run being continued (its ``resolved_config.yaml``), as
    ``{"a.b": (old, new)}``, leaving out those a resumed run may change freely (:data:`RESUME_FREE_KEYS`)."""
    saved = Path(cfg.output_dir) / "resolved_config.yaml"
    if not saved.is_file():
        return {}
    current = OmegaConf.to_container(run_config(cfg), resolve=True)
    return config_changes(OmegaConf.to_container(OmegaConf.load(saved)), current, ignored=RESUME_FREE_KEYS)


def _allowed(key: str, cfg: DictConfig) -> bool:
    return any(key == name or key.startswith(f"{name}.") for name in cfg.resume_allow_changes)


def finished_run_summary(cfg: DictConfig) -> dict | None:
    """With ``resume=true`` in a run that already reached ``train.steps``: its ``summary.json``; else None."""
    checkpoints = list_checkpoints(_checkpoint_root(cfg)) if cfg.resume else []
    summary = Path(cfg.output_dir) / "summary.json"
    if checkpoints and checkpoints[-1][0] >= cfg.train.steps and summary.is_file():
        return json.loads(summary.read_text())
    return None


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
        try:
            SamplingSettings.from_mapping(generation)
        except ValueError as error:
            raise ConfigError(f"rollout.generation: {error}") from None


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


# ----------------------------------------------------------------------------------------------------- factories


@dataclass
class Models:
    """What the learner loads: the policy and its tokenizer, the frozen reference, and the reward model and its
    tokenizer (``None`` when the collector runs in a background process, which loads its own)."""

    tokenizer: Any
    policy: Any
    reference: Any | None
    reward_tokenizer: Any | None
    reward_model: Any | None


def checkpoint_policy_node(cfg: DictConfig, checkpoint: Path) -> DictConfig:
    """The model node of the policy a checkpoint saved (weights and tokenizer in its model folder)."""
    return OmegaConf.merge(cfg.model, {"name_or_path": str(checkpoint / MODEL_FOLDER), "tokenizer_name_or_path": None})


def load_models(cfg: DictConfig, *, resume_from: Path | None) -> Models:
    """The policy comes from the checkpoint when resuming; the reference is always the initial policy (with LoRA, the
    policy with its adapters off: nothing more is loaded)."""
    policy_node = cfg.model if resume_from is None else checkpoint_policy_node(cfg, resume_from)
    # Fresh LoRA adapters are drawn at random: seeded alike on every rank, the same run starts from the same adapters
    # (and FSDP2's ranks, each keeping its own slice of them, from one draw). seed_sampling reseeds per rank later.
    seed_everything(cfg.seed)
    reference = None
    if cfg.loss.kl_to_ref_coeff and cfg.model.lora is None:
        reference = load_causal_lm(cfg.model, device=cfg.device, dtype=cfg.dtype).eval().requires_grad_(False)
    reward_tokenizer = reward_model = None
    if cfg.rollout.mode == "sync":
        reward_tokenizer = load_tokenizer(cfg.reward_model, padding_side="right")
        reward_model = load_reward_model(
            cfg.reward_model, device=cfg.device, dtype=cfg.dtype, pad_token_id=reward_tokenizer.pad_token_id
        ).eval()
    return Models(
        tokenizer=load_tokenizer(policy_node, padding_side="left"),
        # eval(): GRPO's importance ratios compare forward passes that must not differ by dropout.
        policy=load_policy(
            cfg.model, device=cfg.device, dtype=cfg.dtype, saved=None if resume_from is None else policy_node
        ).eval(),
        reference=reference,
        reward_tokenizer=reward_tokenizer,
        reward_model=reward_model,
    )


def make_replay_buffer(cfg: DictConfig):
    """One step's responses (with their advantages), handed out in mini-batches without replacement."""

    return ReplayBuffer(
        storage=LazyStackStorage(cfg.rollout.responses_per_step),
        sampler=SamplerWithoutReplacement(),
        batch_size=cfg.train.mini_batch_size,
    )


def is_on_policy(cfg: DictConfig) -> bool:
    """One update per step: the responses train the very policy that sampled them, old log-probs = current ones."""
    return cfg.train.epochs_per_step == 1 and cfg.train.mini_batch_size == cfg.rollout.responses_per_step


def make_batch_preparation(cfg: DictConfig, models: Models, scorer) -> PrepareBatch:
    """Advantages and reference log-probs; the old log-probs too where the collector records none (``chat``) and a
    step makes several updates. On-policy, the loss takes its own (as trl does with one update per batch)."""
    scores_old = cfg.rollout.env == "chat" and not is_on_policy(cfg)
    return PrepareBatch(
        cfg.rollout.group_size,
        reference=make_reference_log_probs(cfg, models, policy_scorer=scorer),
        policy=scorer if scores_old else None,
        micro_batch_size=cfg.rollout.log_prob_micro_batch_size,
    )


def make_reference_log_probs(cfg: DictConfig, models: Models, *, policy_scorer=None):
    """The frozen reference's log-prob scorer (``None``: no KL term): the initial policy loaded beside the policy, or
    with LoRA the policy with its adapters switched off (its base weights never train). Under FSDP2 the reference is
    sharded as the policy is, and a sharded LoRA policy is scored through ``policy_scorer``, the FSDP2 forward that
    gathers its weights."""
    if not cfg.loss.kl_to_ref_coeff:
        return None
    if cfg.model.lora is not None:
        sharded = is_sharded(models.policy)
        return AdapterDisabledLogProbs(models.policy, scorer=policy_scorer if sharded else None)
    if is_sharded(models.reference):  # fsdp (make_learner shards it with the policy)
        return ShardedResponseLogProbs(models.reference)
    return ResponseLogProbs(models.reference)


def make_loss(cfg: DictConfig, scorer) -> ResponseGRPOLoss:
    # GRPOLoss over the response positions; a batch without old log-probs (on-policy chat) takes the current ones.
    return ResponseGRPOLoss(
        scorer,
        clip_epsilon=cfg.loss.clip_epsilon,
        entropy_bonus=True,  # also what reports train/entropy; its weight in the loss is entropy_coeff
        entropy_coeff=cfg.loss.entropy_coeff,
        kl_to_ref_coeff=cfg.loss.kl_to_ref_coeff or None,
        aggregation=cfg.loss.aggregation,
        masking_strategy="sft",
    )


# ----------------------------------------------------------------------------------------------------- training


def rollout_metrics(data, tokenizer, oracle, *, group_size: int, gather=None) -> tuple[dict[str, float], int]:
    """Reward, oracle and length statistics of one step's responses, and how many tokens were generated.

    ``rollout/frac_reward_zero_std`` is the fraction of groups (each prompt's ``group_size`` contiguous responses)
    whose rewards are all equal: they teach nothing, their advantages are 0. ``gather`` (``pool_over_processes``)
    pools the per-response values of every data-parallel rank first, so that the figures are those of the whole
    step's responses."""
    # Padded rows (pad_rollout): a response is what the attention mask keeps after the prompt columns.
    response_mask = data["masks", "all_attention_mask"][:, data["tokens", "prompt"].shape[-1] :]
    values = {
        "reward": data.get(("next", "reward")).reshape(-1).float(),
        "length": response_mask.sum(-1).double(),
    }
    if oracle is not None:
        responses = [row[mask] for row, mask in zip(data["tokens", "response"], response_mask, strict=True)]
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        values["oracle"] = torch.tensor([float(oracle(t)) for t in texts], dtype=torch.float64)
    if gather is not None:
        values = {key: gather(value) for key, value in values.items()}
    metrics = {
        "rollout/reward_mean": values["reward"].mean().item(),
        "rollout/reward_std": values["reward"].std().item(),
        "rollout/frac_reward_zero_std": (values["reward"].view(-1, group_size).std(-1) == 0).float().mean().item(),
    }
    if oracle is not None:
        metrics["rollout/oracle_mean"] = values["oracle"].mean().item()
    metrics["rollout/response_length"] = values["length"].mean().item()
    return metrics, int(values["length"].sum().item())


def training_loss(out, *, entropy_coeff: float) -> torch.Tensor:
    """The sum of ``GRPOLoss``'s ``loss_*`` terms, without the entropy term when its coefficient is 0.

    That term is then ``0 * entropy``: nothing to the loss, but its backward would run through a softmax over the whole
    vocabulary at every position of the batch (``entropy_bonus=True`` stays on for the ``train/entropy`` metric)."""
    skipped = set() if entropy_coeff else {"loss_entropy"}
    terms = [value for key, value in out.items() if key.startswith("loss_") and key not in skipped]
    return sum(value for value in terms if value is not None)


def optimize(
    cfg: DictConfig, loss_module, optimizer, buffer, parameters: list, *, forward_context=contextlib.nullcontext
) -> dict[str, float]:
    """``train.epochs_per_step`` passes over the buffer in mini-batches; returns the updates' mean diagnostics.

    Each loss forward runs in ``forward_context()`` (bf16 autocast, checkpointed layers: ``Learner.forward_context``),
    its backward outside it."""
    sums: dict[str, float] = {}
    updates = 0
    for _ in range(cfg.train.epochs_per_step):
        for _ in range(cfg.rollout.responses_per_step // cfg.train.mini_batch_size):
            # LazyStackStorage hands out a lazy stack of samples: stacked once here, the loss's logits are not split
            # into per-sample tensors and re-stacked (whose backward copies the whole gradient once per sample).
            with forward_context():
                out = loss_module(buffer.sample().contiguous())
                loss = training_loss(out, entropy_coeff=cfg.loss.entropy_coeff)
            loss.backward()
            # null: no clipping, but the norm is still measured (train/grad_norm).
            max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm is not None else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            updates += 1
            values = {"train/loss": loss, "train/clip_fraction": out.clip_fraction, "train/entropy": out.entropy}
            if out.kl_to_ref is not None:
                values["train/kl_to_ref"] = out.kl_to_ref
            values["train/grad_norm"] = grad_norm
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + float(value.detach().mean())
    return {key: total / updates for key, total in sums.items()}


def summarize(progress: dict, *, window: int, num_processes: int) -> dict:
    """The run's :data:`SUMMARY_KEYS`. ``perf/wall_time_s``: the training steps' time over every invocation (setup
    apart); ``perf/tokens_per_s``: generated tokens per second of rollout (generation, reward, log-prob scoring)."""
    history = progress["history"]
    figures = (
        len(history),
        num_processes,
        progress["tokens_total"],
        progress["wall_time_s"],
        progress["tokens_total"] / max(progress["rollout_time_s"], 1e-9),
        progress["setup_time_s"],
    )
    summary = dict(zip(RUN_FIGURES, figures, strict=True))
    for name in SUMMARY_SERIES:
        values = [row[name] for row in history if name in row]
        if values:
            # The first step samples from the initial policy: the starting point. The end is averaged for stability.
            summary[f"{name}_first"] = values[0]
            summary[f"{name}_last"] = sum(values[-window:]) / len(values[-window:])
    return summary


def train(cfg: DictConfig) -> dict:
    """Runs (or resumes) GRPO as configured and returns the summary also written to ``summary.json``.

    Under torchrun every process calls it; each returns the same summary (metrics are averaged over the processes),
    and rank 0 alone writes the run folder."""
    setup_start = time.perf_counter()
    validate(cfg)
    finished = finished_run_summary(cfg)
    if finished is not None:
        log.info(
            "The run in %s already finished its %d steps: nothing to resume (raise train.steps to train further).",
            cfg.output_dir,
            finished["train/steps"],
        )
        return finished
    # The prompts are read (and refused: missing column, empty prompts, too long...) before any model loads.
    prompts = load_prompts(cfg.data, "train")
    if not prompts:
        raise ConfigError(f"data={cfg.data.source} holds no training prompts; check data.path / data.split.")
    check_prompt_lengths(cfg, prompts)

    run = start_run(
        cfg,
        tidy=[_checkpoint_root(cfg)],
        resume=cfg.resume,
        before_config=functools.partial(record_resume_changes, cfg) if cfg.resume else None,
        backend=None if cfg.distributed.backend == "auto" else cfg.distributed.backend,
    )
    with run:  # the logger closes however the run ends: Hydra multirun jobs share this process
        return _train(cfg, run, prompts=prompts, setup_start=setup_start)


def _train(cfg: DictConfig, run: Run, *, prompts: list, setup_start: float) -> dict:
    """Loads the models (the policy from the newest checkpoint when resuming), builds the learner and the collector,
    trains and summarises."""
    resume_from = latest_checkpoint(_checkpoint_root(cfg)) if cfg.resume else None
    state = load_training_state(resume_from) if resume_from is not None else None
    start_step = state["step"] if state is not None else 0
    models = load_models(cfg, resume_from=resume_from)
    learner = make_learner(cfg, models)
    progress = restore_progress(cfg, run, state, learner.optimizer, policy=models.policy)
    processes, collector = run.processes, None
    try:
        # Last, and inside the try: an async collector is a child process, which the finally below always stops.
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
        progress["setup_time_s"] = time.perf_counter() - setup_start
        train_loop(run, collector, models, learner, progress, prompts=prompts, start_step=start_step)
    finally:
        if collector is not None:
            collector.shutdown()
    summary = summarize(progress, window=cfg.summary.window, num_processes=processes.num_processes)
    return run.finish(summary, closing_message(summary, run.output_dir))


def record_resume_changes(cfg: DictConfig, output_dir: Path) -> None:
    """The settings this resume changes (allowed in validate()), recorded before the new config replaces the old."""
    step = list_checkpoints(_checkpoint_root(cfg))[-1][0]
    changes = resume_changes(cfg)
    record_resume(output_dir, step=step, changes=changes)
    log.info("Resuming %s at step %d%s", output_dir, step, f" with changes {changes}" if changes else "")


@dataclass
class Learner:
    """What updates the policy: the batch preparation (advantages, reference log-probs), the replay buffer, the loss
    (over the policy's log-prob scorer, DDP-wrapped under a launcher), the optimizer and the parameters it clips, and
    the context of each loss forward (``train.mixed_precision``, ``train.gradient_checkpointing``)."""

    prepare: PrepareBatch
    buffer: Any
    loss: ResponseGRPOLoss
    optimizer: torch.optim.Optimizer
    parameters: list
    forward_context: Any = contextlib.nullcontext


def make_learner(cfg: DictConfig, models: Models) -> Learner:
    # The policy's log-probs over the response positions, for the loss (and the old log-probs where a step needs
    # them scored); through DDP or FSDP2 (which shards the policy here, before the optimizer sees its parameters), so
    # that the loss's backward averages the gradients over the ranks. Checkpointing is set on the layers first.
    if cfg.train.gradient_checkpointing:
        enable_activation_checkpointing(models.policy)
    scorer = make_policy_scorer(models.policy, strategy=cfg.distributed.strategy, device=cfg.device)
    if is_sharded(models.policy):
        # fsdp: the frozen reference and reward model too, 1/N of each per process (every process scores as many
        # micro-batches as the others, so their gathers match).
        for frozen in (models.reference, models.reward_model):
            if frozen is not None:
                shard_frozen_model(frozen)
    parameters = trainable_parameters(models.policy)  # all, or LoRA's adapters; a list: clipped at every update
    return Learner(
        prepare=make_batch_preparation(cfg, models, scorer),
        buffer=make_replay_buffer(cfg),
        loss=make_loss(cfg, scorer),
        optimizer=instantiate(cfg.optimizer)(parameters),
        parameters=parameters,
        forward_context=functools.partial(
            update_forward, models.policy, mixed_precision=cfg.train.mixed_precision, device=cfg.device
        ),
    )


def restore_progress(cfg: DictConfig, run: Run, state: dict | None, optimizer, *, policy) -> dict:
    """The run's running totals (history, times, tokens): empty, or the checkpoint's with its optimizer state."""
    progress = {"history": [], "wall_time_s": 0.0, "tokens_total": 0, "rollout_time_s": 0.0}
    if state is None:
        return progress
    if is_sharded(policy):  # the full state save_if_due gathered: each rank keeps its shard
        load_full_optimizer_state(policy, optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(state["optimizer"])
    # The config's optimizer settings win over the checkpoint's (an allowed resume change, e.g. the lr, applies).
    settings = {k: v for k, v in OmegaConf.to_container(cfg.optimizer).items() if not k.startswith("_")}
    for group in optimizer.param_groups:
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in settings.items() if k in group})
    if run.is_main:
        truncate_metrics_csv(run.output_dir / "metrics.csv", state["step"])
    return {key: state[key] for key in progress}


def seed_sampling(cfg: DictConfig, state: dict | None, start_step: int) -> None:
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


def train_loop(run: Run, collector, models: Models, learner: Learner, progress: dict, *, prompts, start_step) -> None:
    """Steps ``start_step + 1 ... train.steps``: collect, update, report, checkpoint."""
    cfg = run.cfg
    oracle = instantiate(cfg.data.oracle) if cfg.data.oracle is not None else None
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
            waited = time.perf_counter() - step_start
            metrics, tokens = train_step(cfg, step, batch, learner, models, collector, oracle, waited=waited)
            metrics["perf/step_time_s"] = time.perf_counter() - step_start
            progress["history"].append(metrics)
            progress["wall_time_s"] += metrics["perf/step_time_s"]
            progress["tokens_total"] += tokens
            progress["rollout_time_s"] += metrics["perf/rollout_time_s"]
            report_step(
                run,
                step,
                metrics,
                bar,
                samples=functools.partial(sample_rollouts, batch, prompts, models.tokenizer, oracle),
            )
            save_if_due(run, step, models, learner.optimizer, progress)
    finally:
        bar.close()


def train_step(cfg, step, batch, learner: Learner, models: Models, collector, oracle, *, waited) -> tuple[dict, int]:
    """One GRPO update on ``batch``: advantages and reference log-probs, the loss over mini-batches, the new weights
    handed to the collector. Returns the step's metrics (averaged over the processes) and its generated tokens."""
    timings = learner.prepare(batch)  # group advantages, reference (and missing old) log-probs
    lag = step - 1 - int(batch["policy_version"].min())
    if lag > cfg.rollout.max_policy_lag:
        raise RuntimeError(
            f"Step {step} got responses sampled {lag} updates ago, more than rollout.max_policy_lag="
            f"{cfg.rollout.max_policy_lag}; the collector did not wait for the weights."
        )
    metrics, tokens = rollout_metrics(
        batch, models.tokenizer, oracle, group_size=cfg.rollout.group_size, gather=pool_over_processes
    )
    if metrics["rollout/frac_reward_zero_std"] == 1.0:
        log.warning(
            "Step %d: in every group the responses got the same reward, so this step teaches nothing. A reward model "
            "that scores everything alike, reward.max_length shorter than the prompts, or responses that are all the "
            "same (temperature too low) do this.",
            step,
        )
    learner.buffer.extend(batch)
    update_start = time.perf_counter()
    updates = optimize(
        cfg,
        learner.loss,
        learner.optimizer,
        learner.buffer,
        learner.parameters,
        forward_context=learner.forward_context,
    )
    learner.buffer.empty()
    collector.update_policy_weights_(models.policy, version=step)
    collected = collector.last_timings
    # Each rank's own diagnostics and times, averaged; the rollout figures above are already global.
    updates.update(
        {
            "train/policy_lag": float(lag),
            "perf/generate_s": collected["generate_s"],
            "perf/reward_s": collected["collect_s"] - collected["generate_s"],
            "perf/advantage_s": timings["advantage_s"],
            "perf/reference_s": timings["log_probs_s"],
            "perf/update_s": time.perf_counter() - update_start,
            "perf/wait_s": waited,
            # Where the responses were collected (here or in the background), plus their preparation.
            "perf/rollout_time_s": collected["collect_s"] + timings["advantage_s"] + timings["log_probs_s"],
        }
    )
    metrics.update(mean_over_processes(updates))
    metrics["perf/tokens_per_s"] = tokens / metrics["perf/rollout_time_s"]
    if not all(math.isfinite(v) for v in metrics.values()):
        raise FloatingPointError(f"Non-finite metrics at step {step}: {metrics}; lower optimizer.lr.")
    return metrics, tokens


def report_step(run: Run, step: int, metrics: dict, bar, *, samples) -> None:
    """The step's metrics to the logger, a progress line every ``log_every_n_steps`` steps and sample rollouts every
    ``samples.every_n_steps`` to the log (``samples(count=n)`` draws them), the live reward on the progress bar."""
    cfg = run.cfg
    run.logger.log(metrics, step=step)
    if run.is_main and (step % cfg.log_every_n_steps == 0 or step == cfg.train.steps):
        log.info(progress_line(step, cfg.train.steps, metrics))
    every = cfg.samples.every_n_steps
    if run.is_main and every is not None and (step % every == 0 or step in (1, cfg.train.steps)):
        drawn = samples(count=max(cfg.samples.log_count, cfg.samples.print_count))
        run.logger.log_samples(drawn[: cfg.samples.log_count], step=step)
        for sample in drawn[: cfg.samples.print_count]:
            log.info("Step %d sample: %s", step, json.dumps(sample, ensure_ascii=False))
    shown = {"reward": f"{metrics['rollout/reward_mean']:.3f}"}
    if "rollout/oracle_mean" in metrics:
        shown["oracle"] = f"{metrics['rollout/oracle_mean']:.3f}"
    bar.set_postfix(shown)
    bar.update(1)


def save_if_due(run: Run, step: int, models: Models, optimizer, progress: dict) -> None:
    """A checkpoint every ``checkpoint.every_n_steps`` steps and at the last: the policy, the optimizer, the running
    totals and every rank's RNG state (so that a resumed run samples as this one would have). A sharded policy's
    weights and optimizer state are gathered whole onto rank 0 first: one ``from_pretrained`` folder, as under DDP."""
    cfg = run.cfg
    every = cfg.checkpoint.every_n_steps
    if not (step == cfg.train.steps or (every is not None and step % every == 0)):
        return
    check_ranks_in_sync(models.policy)
    rng_by_rank = gather_object([capture_rng_state()])
    model, model_state, optimizer_state = models.policy, None, None
    if is_sharded(models.policy):
        model_state, optimizer_state = gather_full_state(models.policy, optimizer)
    if run.is_main:
        if model_state is not None and cfg.checkpoint.save_merged:
            # The merge runs on a whole LoRA policy: rebuilt on this process's CPU from the gathered weights.
            model, model_state = whole_policy_on_cpu(cfg, model_state), None
        state = {key: value for key, value in progress.items() if key != "setup_time_s"}
        save_checkpoint(
            _checkpoint_root(cfg),
            step,
            model=model,
            tokenizer=models.tokenizer,
            optimizer=optimizer,
            state={**state, "rng_by_rank": rng_by_rank},
            keep_last=cfg.checkpoint.keep_last,
            model_state_dict=model_state,
            optimizer_state_dict=optimizer_state,
            save_merged=cfg.checkpoint.save_merged,
        )


def whole_policy_on_cpu(cfg: DictConfig, full_state: dict):
    """A sharded policy rebuilt whole on CPU from its gathered weights (``gather_full_state``): the base read again
    with its adapters, then every weight replaced by the gathered one."""
    policy = load_policy(cfg.model, device="cpu", dtype=cfg.dtype)
    policy.load_state_dict(full_state)
    return policy


def run_description(cfg: DictConfig, *, num_prompts: int, world_size: int) -> str:
    """What the run trains, on what, where: the first line of its log."""
    processes = f" x {world_size} processes" if world_size > 1 else ""
    return (
        f"GRPO ({cfg.rollout.env} env, {cfg.rollout.mode}): policy {cfg.model.name_or_path}, reward model "
        f"{cfg.reward_model.name_or_path} (reward.input={cfg.reward.input}), data={cfg.data.source} "
        f"({num_prompts} prompts); {cfg.train.steps} steps of {cfg.rollout.responses_per_step} responses{processes} "
        f"(groups of {cfg.rollout.group_size}, up to {cfg.rollout.generation.max_new_tokens} new tokens), lr "
        f"{cfg.optimizer.lr}, seed {cfg.seed}, {cfg.device} {cfg.dtype}; run folder {cfg.output_dir}"
    )


def progress_line(step: int, steps: int, metrics: dict[str, float]) -> str:
    """One step's headline figures, for the log every ``log_every_n_steps`` steps."""
    shown = [f"reward {metrics['rollout/reward_mean']:.3f}"]
    if "rollout/oracle_mean" in metrics:
        shown.append(f"oracle {metrics['rollout/oracle_mean']:.3f}")
    if "train/kl_to_ref" in metrics:
        shown.append(f"KL {metrics['train/kl_to_ref']:.4f}")
    shown.append(f"length {metrics['rollout/response_length']:.1f}")
    shown.append(f"{metrics['perf/step_time_s']:.2f} s/step")
    return f"Step {step}/{steps}: {', '.join(shown)}"


def sample_rollouts(batch, prompts: list, tokenizer, oracle, *, count: int) -> list[dict]:
    """``count`` of a step's rollouts, spread over its groups: the prompt as the data gives it, the response's text,
    its reward and, where the data has one, its oracle score."""
    if count < 1:
        return []
    rows = torch.linspace(0, batch.shape[0] - 1, count).round().long().unique().tolist()
    response_mask = batch["masks", "all_attention_mask"][:, batch["tokens", "prompt"].shape[-1] :].bool()
    rewards = batch.get(("next", "reward")).reshape(batch.shape[0], -1)[:, 0]
    samples = []
    for row in rows:
        response = tokenizer.decode(batch["tokens", "response"][row][response_mask[row]], skip_special_tokens=True)
        prompt = prompts[int(batch["prompt_index"][row])]
        if not isinstance(prompt, str):  # a conversation
            prompt = "\n".join(f"{message['role']}: {message['content']}" for message in prompt)
        sample = {"prompt": prompt, "response": response, "reward": round(float(rewards[row]), 4)}
        if oracle is not None:
            sample["oracle"] = round(float(oracle(response)), 4)
        samples.append(sample)
    return samples


def closing_message(summary: dict, output_dir: Path) -> str:
    """Where the run is, its headline figures and what to run next."""
    oracle = ""
    if "rollout/oracle_mean_first" in summary:
        oracle = f", oracle {summary['rollout/oracle_mean_first']:.3f} -> {summary['rollout/oracle_mean_last']:.3f}"
    return (
        f"GRPO done: {summary['train/steps']} steps in {summary['perf/wall_time_s']:.1f} s "
        f"({summary['perf/tokens_per_s']:.0f} "
        f"generated tokens/s of rollout); reward {summary['rollout/reward_mean_first']:.3f} -> "
        f"{summary['rollout/reward_mean_last']:.3f}{oracle}. Run folder: {output_dir}. Curves: python "
        f"scripts/plot_run.py {output_dir}"
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="grpo_torchrl_rm")
def main(cfg: DictConfig) -> float:
    # TorchRL 0.14.1's own internals trigger these; there is nothing a user of the recipe can do about them.
    warnings.filterwarnings("ignore", message="size_average and reduce args will be deprecated")
    warnings.filterwarnings("ignore", message="The env passed to LLMCollector is missing transforms")
    summary = run_recipe(train, cfg)
    return summary[cfg.metric]


if __name__ == "__main__":
    main()
    end_processes()
