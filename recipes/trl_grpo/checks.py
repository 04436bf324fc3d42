"""Every check of a ``conf/trl_grpo_torchrl_rollouts.yaml`` config that runs before any model loads: the schema
(``recipes.trl_grpo.schema``; ``train:``'s keys against ``trl.GRPOConfig``'s fields) and every rule that crosses keys;
each message names the setting, what was found and what to change.

Dependencies: omegaconf, transformers, trl (for ``train:``'s keys), and the recipes' own modules.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from interop.sampling import SamplingSettings
from recipes.common.checkpoint import latest_trl_checkpoint
from recipes.common.config import ConfigError, check_run_settings
from recipes.common.data import load_prompt_rows
from recipes.common.lora import validate_policy_lora
from recipes.common.models import validate_model_node
from recipes.common.reward_functions import check_reward_functions
from recipes.common.run import check_sharded_launch
from recipes.common.run_folder import check_output_folder, input_paths
from recipes.common.schema import checked_config, checked_trainer_config
from recipes.trl_grpo.schema import RENAMED, GRPOTrainerNode, TrlGRPORecipeConfig

__all__ = ["validate"]


def validate(cfg: DictConfig) -> DictConfig:
    """Every check that runs before any model loads; returns the config the run trains with (resolved once)."""
    from trl import GRPOConfig  # trl prints a notice on import: only where this recipe runs

    cfg = checked_config(cfg, TrlGRPORecipeConfig, recipe="trl_grpo_torchrl_rollouts", renamed=RENAMED)
    args = checked_trainer_config(cfg.train, GRPOConfig, node=GRPOTrainerNode)
    _check_trainer_settings(args)
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
    check_run_settings(cfg)
    check_output_folder(cfg.output_dir, overwrite=cfg.overwrite, resume=cfg.resume, inputs=input_paths(cfg))
    check_sharded_launch(cfg.device)
    if cfg.resume and latest_trl_checkpoint(args.output_dir) is None:
        raise ConfigError(
            f"resume=true, but {args.output_dir} holds no trl checkpoint (checkpoint-<step>/) to continue from: "
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


def _check_trainer_settings(args) -> None:
    """What ``train:``'s settings, as trl will read them (``args``: trl's defaults under the config's values), cannot
    combine: the sampler's settings, and the group size against the generation batch."""
    try:
        SamplingSettings.from_grpo_config(args)
    except ValueError as error:
        raise ConfigError(
            f"train.{error}" if str(error).startswith("generation_kwargs") else f"train: {error}"
        ) from None
    per_device, group = args.per_device_train_batch_size, args.num_generations
    steps_per_generation = args.steps_per_generation or args.gradient_accumulation_steps
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    generation_batch = per_device * steps_per_generation * processes
    if not isinstance(group, int) or group < 2 or generation_batch % group:
        raise ConfigError(
            f"train.num_generations={group} does not divide the generation batch of {generation_batch} completions "
            f"(train.per_device_train_batch_size={per_device} x steps_per_generation={steps_per_generation} x "
            f"{processes} process(es)): every prompt's group must be whole. Use a group size of 2 or more that "
            f"divides {generation_batch}, or change the batch size."
        )
