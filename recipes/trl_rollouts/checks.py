"""The keys ``conf/trl_grpo_torchrl_rollouts.yaml`` may hold (``recipes.common.schema``; ``train:`` is
``trl.GRPOConfig``, its keys checked against trl's fields) and every rule that crosses them, checked before any model
loads; each message names the setting, what was found and what to change.

Dependencies: omegaconf, transformers, trl (for ``train:``'s keys), and the recipes' own modules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from omegaconf import DictConfig

from recipes.common.config import ConfigError, check_run_settings
from recipes.common.data import load_prompt_rows
from recipes.common.lora import validate_policy_lora
from recipes.common.models import validate_model_node
from recipes.common.run import check_sharded_launch
from recipes.common.run_folder import check_output_folder, input_paths
from recipes.common.schema import (
    OPEN,
    DataNode,
    LoggerNode,
    ModelNode,
    Range,
    check_trainer_config_keys,
    checked_config,
)
from recipes.grpo.reward_functions import check_reward_functions
from recipes.grpo.sampling import SamplingSettings

__all__ = ["TrlRolloutsConfig", "latest_trainer_checkpoint", "sampling_settings", "validate"]

Positive = Annotated[int, Range(ge=1)]
# trl.GRPOConfig's generation_kwargs that the TorchRL sampler takes (the others are SamplingSettings fields trl names).
_GENERATION_KWARGS = ("min_new_tokens",)


@dataclass
class Rollout:
    prompts_per_draw: Positive


@dataclass
class Reward:
    model_weight: float
    # name -> {function, weight}: the names are the user's (recipes.grpo.reward_functions checks each node).
    functions: Annotated[dict[str, Any], OPEN]


@dataclass
class Rollouts:
    max_rows: Positive
    max_text_bytes: Positive


@dataclass
class TrlRolloutsConfig:
    """``conf/trl_grpo_torchrl_rollouts.yaml`` with its groups (``model``, ``reward_model``, ``data``, ``logger``)."""

    model: ModelNode
    reward_model: ModelNode | None
    data: DataNode
    logger: LoggerNode
    seed: Annotated[int, Range(ge=0)]
    device: str
    dtype: str
    num_threads: int | None
    output_dir: str
    metric: str
    resume: bool
    overwrite: bool
    system_prompt: str | None
    rollout: Rollout
    reward: Reward
    rollouts: Rollouts
    # trl.GRPOConfig's own fields (checked against trl's), plus its _target_.
    train: Annotated[dict[str, Any], OPEN]


def sampling_settings(train: DictConfig) -> SamplingSettings:
    """The TorchRL sampler's settings from trl's: ``max_completion_length``, ``temperature``, ``top_k`` (0: off),
    ``top_p``, ``min_p``, ``repetition_penalty`` and ``generation_kwargs.min_new_tokens``."""
    extra = dict(train.get("generation_kwargs") or {})
    return SamplingSettings(
        max_new_tokens=train.max_completion_length,
        min_new_tokens=int(extra.get("min_new_tokens", 0)),
        temperature=float(train.get("temperature", 1.0)),
        top_k=train.get("top_k") or None,
        top_p=float(train.get("top_p", 1.0)),
        min_p=train.get("min_p"),
        repetition_penalty=float(train.get("repetition_penalty", 1.0)),
    )


def latest_trainer_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest of trl's ``checkpoint-<step>`` folders in ``output_dir`` (``train.output_dir``), or ``None``."""
    from transformers.trainer_utils import get_last_checkpoint

    folder = Path(output_dir)
    return get_last_checkpoint(str(folder)) if folder.is_dir() else None


def validate(cfg: DictConfig) -> DictConfig:
    """Every check that runs before any model loads; returns the config the run trains with (resolved once)."""
    from trl import GRPOConfig  # trl prints a notice on import: only where this recipe runs

    cfg = checked_config(cfg, TrlRolloutsConfig, recipe="trl_grpo_torchrl_rollouts")
    check_trainer_config_keys(cfg.train, GRPOConfig)
    _check_trainer_settings(cfg)
    if cfg.reward_model is None and not cfg.reward.functions:
        raise ConfigError(
            "reward_model=none and no reward.functions: nothing would score the completions. Keep a reward model "
            "(reward_model=tiny) or add a function (reward.functions.<name>.function=<dotted path>)."
        )
    validate_model_node(cfg.model, key="model", kind="policy")
    if cfg.reward_model is not None:
        validate_model_node(cfg.reward_model, key="reward_model")
    validate_policy_lora(cfg)
    _check_lora_for_trl(cfg.model.lora)
    check_run_settings(
        cfg,
        lr_key="train.learning_rate",
        max_grad_norm_key="train.max_grad_norm",
        batch_size_key="train.per_device_train_batch_size",
    )
    check_output_folder(cfg.output_dir, overwrite=cfg.overwrite, resume=cfg.resume, inputs=input_paths(cfg))
    check_sharded_launch(cfg.device)
    if cfg.resume and latest_trainer_checkpoint(cfg.train.output_dir) is None:
        raise ConfigError(
            f"resume=true, but {cfg.train.output_dir} holds no trl checkpoint (checkpoint-<step>/) to continue from: "
            "the run must save them (train.save_strategy=steps, train.save_steps=N)."
        )
    rows = load_prompt_rows(cfg.data, "train")
    check_reward_functions(cfg, columns=list(rows.columns))
    return cfg


def _check_lora_for_trl(lora) -> None:
    """trl's GRPOTrainer refuses an adapter on the output head (it computes log-probs from ``lm_head.weight``
    directly, so the adapter would never train): said here, before any model loads."""
    if lora is None or isinstance(lora.target_modules, str):
        return
    heads = [name for name in lora.target_modules if name == "lm_head" or str(name).endswith(".lm_head")]
    if heads:
        raise ConfigError(
            f"model.lora.target_modules names {heads[0]}: trl's GRPOTrainer computes log-probs from lm_head.weight "
            "directly, so an adapter there would never train (trl refuses it). Drop it from model.lora.target_modules "
            "(all-linear leaves the head out)."
        )


def _check_trainer_settings(cfg: DictConfig) -> None:
    train = cfg.train
    max_steps = train.get("max_steps")
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps <= 0:
        raise ConfigError(
            f"train.max_steps={max_steps!r}: trl reads the prompt buffer as a stream (no length), so the number of "
            "optimizer steps must be given: train.max_steps=<positive int>."
        )
    if str(train.get("eval_strategy", "no")) != "no" or train.get("do_eval"):
        raise ConfigError(
            f"train.eval_strategy={train.get('eval_strategy')!r} / train.do_eval: this recipe hands trl no "
            "eval_dataset yet (its rollout store and figures would take evaluation batches for training ones). Drop "
            "them; held-out evaluation of a GRPO policy: recipes/grpo_torchrl_rm.py eval.every_n_steps=N."
        )
    if train.get("use_vllm"):
        raise ConfigError(
            "train.use_vllm=true: this recipe's completions come from TorchRL (interop.TorchRLRolloutFunc), not vLLM; "
            "drop train.use_vllm (or use trl's own GRPOTrainer for vLLM generation)."
        )
    unknown = sorted(set(map(str, train.get("generation_kwargs") or {})) - set(_GENERATION_KWARGS))
    if unknown:
        raise ConfigError(
            f"train.generation_kwargs.{unknown[0]}: the TorchRL sampler does not take it (it takes "
            f"{list(_GENERATION_KWARGS)} there, and temperature, top_k, top_p, min_p, repetition_penalty as "
            "train.<name>); drop it."
        )
    try:
        sampling_settings(train)
    except ValueError as error:
        raise ConfigError(f"train: {error}") from None
    per_device, group = train.get("per_device_train_batch_size", 8), train.get("num_generations", 8)
    steps_per_generation = train.get("steps_per_generation") or train.get("gradient_accumulation_steps", 1)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    generation_batch = per_device * steps_per_generation * processes
    if not isinstance(group, int) or group < 2 or generation_batch % group:
        raise ConfigError(
            f"train.num_generations={group} does not divide the generation batch of {generation_batch} completions "
            f"(train.per_device_train_batch_size={per_device} x steps_per_generation={steps_per_generation} x "
            f"{processes} process(es)): every prompt's group must be whole. Use a group size of 2 or more that "
            f"divides {generation_batch}, or change the batch size."
        )
