"""Every check of a GRPO config that can run before the models load: :func:`validate`, then, once the prompts are
read, :func:`check_prompt_lengths` (tokenizers and model configs only). Each message names the setting, what was found
and what to change.

The range, the choices and the rules within one node of every key are the schema's (``recipes.grpo.schema``); here are
the rules across nodes, and what needs the files (models, checkpoints, the run folder) or the machine.

The run reads the typed settings these checks build (``GRPORecipeConfig``: :func:`validate`); the resolved
``DictConfig`` stays beside them as the run's record only (:func:`validated`): what ``resolved_config.yaml`` and the
logger get (secrets masked), what a resume compares with the run it continues, the paths a run reads.

Dependencies: torch, omegaconf, transformers (``AutoConfig``), and the recipe's own modules.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig

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
from recipes.common.prompts import check_prompts_fit_policy
from recipes.common.resume import check_resume_changes, read_metrics_rows
from recipes.common.reward_functions import check_reward_functions
from recipes.common.rollout_backend import backend_of, check_rollout_backend, samples_apart
from recipes.common.run_folder import check_output_folder, check_writable
from recipes.common.schema import config_view
from recipes.common.tools import resolve_tools
from recipes.common.validation import ValidatedRun, validated_run
from recipes.grpo.checkpointing import (
    checkpoint_policy_node,
    checkpoint_root,
    resume_changes,
    resumed_config,
)
from recipes.grpo.collector import check_generation_settings, check_tool_template, make_prompt_table, sampler_settings
from recipes.grpo.evaluation import check_eval_settings
from recipes.grpo.report import summary_keys
from recipes.grpo.rewards import check_reward_keys, check_reward_sources, reward_prompt_lengths
from recipes.grpo.rollout_envs import ROLLOUT_ENVS
from recipes.grpo.schema import RENAMED, TRL_NAMES, GRPORecipeConfig, Rollout

__all__ = ["check_prompt_lengths", "validate", "validated"]

log = logging.getLogger(__name__)


def validate(cfg: DictConfig) -> GRPORecipeConfig:
    """Every check that needs nothing loaded; each message says what to change. Returns the typed settings the run
    trains with: resolved once (every later reader, the background collector included, sees the same values), the
    run's own config under a resumed run's command line (``recipes.grpo.checkpointing.resumed_config``), LoRA on or off
    as the command line says (``recipes.common.lora.settle_lora_node``)."""
    return validated(cfg).settings


def validated(cfg: DictConfig) -> ValidatedRun[GRPORecipeConfig]:
    """:func:`validate`'s checks; returns the typed settings and the resolved config beside them (the run's record:
    what a resume changes is ``record_resume_changes`` in the recipe)."""
    return validated_run(
        cfg,
        GRPORecipeConfig,
        recipe="grpo_torchrl_rm",
        check=_validate_settings,
        renamed=RENAMED,
        aliases=TRL_NAMES,
        resumed_config=resumed_config,
        resume_changes=resume_changes,
    )


def _validate_settings(cfg: GRPORecipeConfig, *, inputs: dict[str, str | None], changes: Callable[[], dict]) -> None:
    # recipes.common.models merges a model node with OmegaConf (an adapter's base): it reads a DictConfig view.
    model = config_view(cfg.model)
    reward_model = config_view(cfg.reward_model) if cfg.reward_model is not None else None
    _validate_batches(cfg)
    _validate_backend(cfg)
    _validate_memory(cfg)
    _validate_generation(cfg.rollout)
    _validate_tools(cfg)
    _validate_rewards(cfg)
    check_eval_settings(cfg)
    _validate_reporting(cfg)  # after the evaluation's: which eval figures there are depends on its settings
    _validate_algorithm(cfg)
    check_run_settings(cfg)
    _validate_distributed(cfg)
    validate_model_node(model, key="model", kind="policy")
    if reward_model is not None:
        validate_model_node(reward_model, key="reward_model", kind="reward_model")
    _validate_lora(cfg)
    check_tokenizer_fits_model(model, key="model")
    if reward_model is not None:
        check_tokenizer_fits_model(reward_model, key="reward_model")
    if cfg.data.source == "file" and not Path(str(cfg.data.path)).expanduser().exists():
        raise ConfigError(
            f"data.path={str(cfg.data.path)!r}: no such file. Point it at a .jsonl/.json/.parquet/.csv file with a "
            f"{cfg.data.prompt_column!r} column of prompts."
        )
    check_output_folder(cfg.output_dir, resume=cfg.resume, overwrite=cfg.overwrite, inputs=inputs)
    if checkpoint_root(cfg).exists():  # a new one is made in the output folder, just checked
        check_writable(
            checkpoint_root(cfg),
            what="the run's checkpoints folder",
            fix="fix its permissions, or run in another folder",
        )
    _validate_resume(cfg, changes)


def _validate_tools(cfg: GRPORecipeConfig) -> None:
    """The ``tools:`` node (each tool importable, callable, typed and documented: ``recipes.common.tools``) and what
    a tool-calling rollout cannot combine with."""
    if resolve_tools(cfg.tools) is None:
        return
    if not ROLLOUT_ENVS[cfg.rollout.env].samples_tool_dialogs:
        # TorchRL 0.14.1's ChatEnv cannot sample GRPO's multi-turn groups (docs/tools.md, "TorchRL's tool
        # transforms"): TorchRL's tool pieces run through rollout.env=prompt instead, as tools.<label>.torchrl.
        raise ConfigError(
            "tools with rollout.env=chat: TorchRL 0.14.1's ChatEnv cannot sample multi-turn tool dialogs in GRPO "
            "groups (it refuses [prompts, group] batches, pads rows that called fewer tools with '<none>' messages "
            "the model then reads, and keeps rows that answered talking). Use rollout.env=prompt: Python tools "
            "(tools.<name>.function) and TorchRL's tool pieces (tools.<label>.torchrl: {_target_: "
            "torchrl.envs.llm.transforms.PythonInterpreter | ExecuteToolsInOrder | SimpleToolTransform | "
            "ToolRegistry, ...}) and MCP servers (tools.<label>.mcp.servers) run there, multi-turn, tool messages out "
            "of the loss."
        )
    if cfg.distributed.strategy == "fsdp" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "tools with distributed.strategy=fsdp: each process's dialogs take their own number of turns, so the "
            "processes would run different numbers of forward passes while a sharded policy needs every process in "
            "every one. Use distributed.strategy=ddp with tools."
        )


def _validate_rewards(cfg: GRPORecipeConfig) -> None:
    """The reward sources: at least one, distinct names, the keys every source reads; the trl functions themselves are
    checked once the data's columns are known (:func:`check_prompt_lengths`)."""
    check_reward_sources(cfg)
    if cfg.reward.functions and not ROLLOUT_ENVS[cfg.rollout.env].carries_data_rows:
        raise ConfigError(
            "reward.functions run on rollout.env=prompt steps (they read each prompt's data row); with "
            "rollout.env=chat use reward.terms (TensorDict modules reading TorchRL's chat layout), or "
            "rollout.env=prompt."
        )
    check_reward_keys(cfg)


def _validate_batches(cfg: GRPORecipeConfig) -> None:
    """How a step's responses split into mini-batches and optimizer steps (the group layout is ``rollout:``'s own)."""
    per_step, mini = cfg.rollout.responses_per_step, cfg.train.mini_batch_size
    if per_step % mini:
        raise ConfigError(
            f"train.mini_batch_size={mini} does not divide rollout.responses_per_step={per_step}; each step's "
            "responses are split into equal mini-batches. Pick a divisor (e.g. train.mini_batch_size="
            f"{per_step // 2 if per_step % 2 == 0 else per_step})."
        )
    accumulation = cfg.train.gradient_accumulation_steps
    if (per_step // mini) % accumulation:
        raise ConfigError(
            f"train.gradient_accumulation_steps={accumulation} does not divide the {per_step // mini} mini-batches of "
            f"a step (rollout.responses_per_step={per_step} / train.mini_batch_size={mini}): every optimizer step "
            "accumulates as many. Pick a divisor."
        )


def _validate_backend(cfg: GRPORecipeConfig) -> None:
    """Where the batches are sampled (``rollout.backend``, ``rollout.workers``, ``ray:``): the keys' shared checks,
    then what this recipe's collectors need: whole groups for every worker, and a collector that runs apart."""
    check_rollout_backend(cfg, workers_per_process=True)
    if not samples_apart(cfg):
        return
    backend = backend_of(cfg)
    if not ROLLOUT_ENVS[cfg.rollout.env].runs_apart:
        raise ConfigError(
            f"rollout.env={cfg.rollout.env} with rollout.backend={backend}: TorchRL's ChatEnv collector samples in "
            "the learner's process only. Use rollout.env=prompt for workers apart from the learner, or "
            "rollout.backend=learner."
        )
    per_step, group, workers = cfg.rollout.responses_per_step, cfg.rollout.group_size, cfg.rollout.workers
    if per_step % (group * workers):
        groups = per_step // group
        raise ConfigError(
            f"rollout.responses_per_step={per_step} does not split into whole groups of rollout.group_size={group} "
            f"over rollout.workers={workers}: each worker samples responses_per_step / workers responses, whole groups "
            f"only ({groups} groups per step). Use a number of workers that divides {groups}, or "
            f"rollout.responses_per_step={group * workers * max(1, groups // workers)}."
        )
    if cfg.advantage.filter_zero_std_groups and cfg.rollout.mode == "sync":
        raise ConfigError(
            f"advantage.filter_zero_std_groups=true with rollout.backend={backend}: the workers sample one batch per "
            "update, each waiting for the weights of the update before it, so the extra batches dynamic sampling "
            "draws within a step would never come. Use rollout.backend=learner with it."
        )


def _validate_algorithm(cfg: GRPORecipeConfig) -> None:
    """What the loss, the advantage and the rollout cannot combine, with the reason."""
    loss = cfg.loss  # its warning on cispo without clip_epsilon_high is the node's own (recipes.grpo.schema.Loss)
    if loss.sync_ref_model and cfg.model.lora is not None:
        raise ConfigError(
            "loss.sync_ref_model=true with model.lora: the reference is the base model with the adapters switched off, "
            "which no update may move (the policy is built on it). Use full fine-tuning (model.lora=null) to sync the "
            "reference, or loss.sync_ref_model=false."
        )
    if loss.sampler_correction.enabled and not ROLLOUT_ENVS[cfg.rollout.env].records_sampler_log_probs:
        raise ConfigError(
            "loss.sampler_correction.enabled=true with rollout.env=chat: the correction weighs the loss by the "
            "trainer's and the sampler's log-probs, and TorchRL's TransformersWrapper records no usable sampler "
            "log-probs (it zeroes each response's first one). Use rollout.env=prompt (its sampler records them), or "
            "loss.sampler_correction.enabled=false."
        )
    budget = cfg.train.max_tokens_per_micro_batch
    if budget is not None and (loss.entropy_coeff or loss.top_entropy_quantile < 1.0):
        raise ConfigError(
            f"train.max_tokens_per_micro_batch={budget} with loss.entropy_coeff={loss.entropy_coeff} and "
            f"loss.top_entropy_quantile={loss.top_entropy_quantile}: the entropy bonus is a token mean and the entropy "
            "mask a quantile over the whole mini-batch, which micro-batches cannot reproduce exactly. Set "
            "train.max_tokens_per_micro_batch=null (bound memory with train.mini_batch_size instead), or "
            "loss.entropy_coeff=0 and loss.top_entropy_quantile=1.0."
        )
    if cfg.advantage.filter_zero_std_groups and cfg.rollout.mode == "async":
        raise ConfigError(
            "advantage.filter_zero_std_groups=true with rollout.mode=async: the background collector samples one batch "
            "per update under the policy-lag bound, and the extra batches dynamic sampling draws would break that "
            "bound. Use rollout.mode=sync with it."
        )


def _validate_reporting(cfg: GRPORecipeConfig) -> None:
    """The metric main() returns must be one the run writes."""
    metric = str(cfg.metric)
    known = summary_keys(cfg)
    if metric not in known:
        raise ConfigError(f"metric={metric!r} is not a summary.json entry; use one of {sorted(known)}.")
    if "oracle" in metric and cfg.data.oracle is None:
        raise ConfigError(
            f"metric={metric!r} needs an oracle, but data.oracle is null for data.source={cfg.data.source!r}; "
            "use metric=rollout/reward_mean_last."
        )


def _validate_lora(cfg: GRPORecipeConfig) -> None:
    validate_policy_lora(
        config_view(cfg.model), config_view(cfg.reward_model) if cfg.reward_model is not None else None
    )
    if cfg.checkpoint.save_merged and cfg.model.lora is None:
        raise ConfigError(
            "checkpoint.save_merged=true merges LoRA adapters into a full model, but model.lora is null: the "
            "checkpoint's model folder already is the full model. Drop checkpoint.save_merged, or set model.lora."
        )


def _validate_memory(cfg: GRPORecipeConfig) -> None:
    if cfg.train.mixed_precision == "bf16" and cfg.dtype != "float32":
        raise ConfigError(
            f"train.mixed_precision=bf16 with dtype={cfg.dtype}: bf16 autocast is for float32 weights (the optimizer "
            "then updates float32 master weights while the forward computes in bfloat16). With weights already in "
            f"{cfg.dtype} it changes nothing; use dtype=float32 with train.mixed_precision=bf16, or keep "
            f"dtype={cfg.dtype} with train.mixed_precision=no."
        )


def _validate_resume(cfg: GRPORecipeConfig, changes: Callable[[], dict]) -> None:
    """A resumed run continues a whole checkpoint, before train.steps, with the run's own settings (``changes()``:
    what this resume changes, read from the run's records; those not named in resume_allow_changes are refused)."""
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
        validate_model_node(config_view(checkpoint_policy_node(cfg, checkpoint)), key="model", kind="policy")
        check_resume_changes(changes(), allowed=cfg.resume_allow_changes)


def check_prompt_lengths(cfg: GRPORecipeConfig, prompts) -> None:
    """Prompts the models cannot read whole: refused when the policy's positions cannot hold the rendered prompt plus
    ``max_new_tokens``; warned (refused if every prompt) when ``reward.max_length`` cuts the reward model's input
    before the response starts, where every response to the prompt gets the same reward. The trl reward functions
    are checked against the prompts' columns (``recipes.common.reward_functions.check_reward_functions``). Tokenizers
    only, no model.
    """

    model = config_view(cfg.model)
    tokenizer = load_tokenizer(model, padding_side="left")
    check_tool_template(cfg, tokenizer)
    table = make_prompt_table(cfg, prompts, tokenizer)  # with the tools' schemas, as the policy reads them
    lengths = torch.tensor(table.rendered_lengths())
    check_prompts_fit_policy(
        lengths,
        model,
        max_new_tokens=cfg.rollout.generation["max_new_tokens"],
        max_new_tokens_key="rollout.generation.max_new_tokens",
    )
    check_reward_functions(cfg.reward.functions, columns=list(table.columns))
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


def _validate_generation(rollout: Rollout) -> None:
    """``rollout.generation`` is open: its keys and values are those of the sampler ``rollout.env`` picks."""
    check_generation_settings(rollout.generation, env=rollout.env)
    if ROLLOUT_ENVS[rollout.env].takes_sampler_settings:
        sampler_settings(rollout.generation)


def _validate_distributed(cfg: GRPORecipeConfig) -> None:
    backend = cfg.distributed.backend
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


def _validate_strategy(cfg: GRPORecipeConfig) -> None:
    if cfg.distributed.strategy != "fsdp":
        return
    # Outside torchrun (or with one process) there is nothing to shard over: the run trains as with ddp.
    if cfg.rollout.mode == "async":
        raise ConfigError(
            "distributed.strategy=fsdp with rollout.mode=async: the background collector samples with a whole copy "
            "of the policy, refreshed from the learner's weights, which sharding splits between the processes. Use "
            "rollout.mode=sync with fsdp, or distributed.strategy=ddp for async collection."
        )
    if cfg.train.max_tokens_per_micro_batch is not None:
        raise ConfigError(
            f"distributed.strategy=fsdp with train.max_tokens_per_micro_batch={cfg.train.max_tokens_per_micro_batch}: "
            "every sharded forward needs every process, and processes cut their mini-batches into different numbers "
            "of micro-batches. Use train.max_tokens_per_micro_batch=null with fsdp (bound memory with "
            "train.mini_batch_size), or distributed.strategy=ddp."
        )
    if not ROLLOUT_ENVS[cfg.rollout.env].keeps_processes_in_step:
        raise ConfigError(
            "distributed.strategy=fsdp with rollout.env=chat: TorchRL's TransformersWrapper calls generate(), which "
            "stops decoding per process when its rows are done, while a sharded policy needs every process in every "
            "forward pass. Use rollout.env=prompt (its sampler keeps the processes in step) with fsdp, or "
            "distributed.strategy=ddp with rollout.env=chat."
        )
