"""Every check of a reward-recipe config that runs before anything loads; each message names the setting, what was
found and what to change. The range, the choices and the rules within one node of every key are the schema's
(``recipes.reward.schema``); here are the rules across nodes, and what needs the files or the machine.

The run reads the typed settings these checks build (``RewardRecipeConfig``: :func:`validate`); the resolved
``DictConfig`` stays beside them as the run's record only (:func:`validated`).

Dependencies: omegaconf, and the recipe's own modules.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from recipes.common.chat import check_chat_generation_settings
from recipes.common.config import ConfigError, check_run_settings
from recipes.common.lora import check_lora_targets
from recipes.common.models import check_tokenizer_fits_model, meta_model, validate_model_node
from recipes.common.run import check_sharded_launch
from recipes.common.run_folder import check_output_folder, check_trainer_output_dir
from recipes.common.schema import config_view
from recipes.common.validation import ValidatedRun, validated_run
from recipes.reward.pair_store import read_meta
from recipes.reward.schema import RewardRecipeConfig, checked_reward_trainer_config

__all__ = ["kept_records", "validate", "validated"]


def validate(cfg: DictConfig) -> RewardRecipeConfig:
    """Every check that runs before any model, tokenizer or dataset loads; returns the typed settings the run trains
    with (resolved once, LoRA on or off as the command line says: ``recipes.common.lora.settle_lora_node``)."""
    return validated(cfg).settings


def validated(cfg: DictConfig) -> ValidatedRun[RewardRecipeConfig]:
    """:func:`validate`'s checks; returns the typed settings and the resolved config beside them (the run's record)."""
    return validated_run(cfg, RewardRecipeConfig, recipe="reward_trainer_from_buffer", check=_validate_settings)


def _validate_settings(cfg: RewardRecipeConfig, *, inputs: dict[str, str | None]) -> None:
    args = checked_reward_trainer_config(cfg.train)
    check_trainer_output_dir(cfg.output_dir, args.output_dir)
    # recipes.common.models merges a model node with OmegaConf (an adapter's base): it reads a DictConfig view.
    model, reward_model = config_view(cfg.model), config_view(cfg.reward_model)
    if cfg.buffer.load_from is not None:
        read_meta(Path(cfg.buffer.load_from).expanduser())  # the rest of the folder is checked as it loads
    elif cfg.data.source == "synthetic":
        validate_model_node(model, key="model", kind="policy")
        check_chat_generation_settings(cfg.generation.generate_kwargs, key="generation.generate_kwargs")
        _check_labeler(cfg.labeler)
    elif cfg.margin_in_loss:
        raise ConfigError(
            f"margin_in_loss=true, but data={cfg.data.source} pairs carry no margin; set margin_in_loss=false."
        )
    check_output_folder(cfg.output_dir, overwrite=cfg.overwrite, inputs=inputs, keep=kept_records(cfg))
    check_sharded_launch(cfg.device)
    check_run_settings(cfg)
    validate_model_node(reward_model, key="reward_model")
    check_tokenizer_fits_model(reward_model, key="reward_model")
    if cfg.reward_model.lora is not None:
        check_lora_targets(
            cfg.reward_model.lora, meta_model(reward_model, kind="reward_model"), key="reward_model.lora"
        )
    if cfg.model.lora is not None:
        raise ConfigError(
            "model.lora is set, but this recipe trains the reward model, not the policy that samples the candidate "
            "responses. Set reward_model.lora instead (and keep model.lora null)."
        )


def kept_records(cfg: RewardRecipeConfig) -> list[str]:
    """What ``overwrite=true`` keeps of the run folder: the buffer folder this run reloads, if it is there."""
    return [cfg.buffer.load_from] if cfg.buffer.load_from else []


def _check_labeler(node: dict) -> None:
    """Builds the labeler (no model needed) so that a bad setting of it is refused now, not after generation."""
    import hydra

    try:
        hydra.utils.instantiate(node)
    except Exception as error:  # Hydra wraps the constructor's own error; its message names the setting
        cause = error.__cause__ or error
        raise ConfigError(f"labeler: {cause} Fix the labeler's settings (labeler.*).") from None
