"""The keys ``conf/reward_trainer_from_buffer.yaml`` may hold and what each may be (``recipes.common.schema``): a key
the recipe does not read, a wrong type, a non-finite number or a value out of range is refused before anything
loads. ``train:`` is ``trl.RewardConfig``: its keys are checked against trl's own fields
(:func:`check_reward_config_keys`). Defaults live in the YAML, not here.

Dependencies: the project's ``recipes.common.schema``; ``trl`` for the ``train:`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from omegaconf import DictConfig

from recipes.common.schema import OPEN, DataNode, LoggerNode, ModelNode, Range, check_trainer_config_keys

__all__ = ["RewardRecipeConfig", "check_reward_config_keys"]

Positive = Annotated[int, Range(ge=1)]
Key = str | list[str]


@dataclass
class Generation:
    responses_per_prompt: int
    prompts_per_batch: Positive
    # Any transformers GenerationConfig field (recipes.common.chat.check_chat_generation_settings checks the keys).
    generate_kwargs: Annotated[dict[str, Any], OPEN]


@dataclass
class Eval:
    holdout_fraction: float
    micro_batch_size: Positive | None
    history_key: Key
    text_key: Key
    reward_key: Key


@dataclass
class PairKeys:
    margin: Key
    chosen_tokens: Key
    rejected_tokens: Key
    chosen_length: Key
    rejected_length: Key


@dataclass
class Buffer:
    storage: str
    path: str | None
    load_from: str | None
    sampler: Any  # a _target_ node: a TorchRL sampler
    pair_keys: PairKeys


@dataclass
class RewardRecipeConfig:
    """``conf/reward_trainer_from_buffer.yaml`` with its groups (``model``, ``reward_model``, ``data``, ``buffer``,
    ``logger``)."""

    model: ModelNode
    reward_model: ModelNode
    data: DataNode
    buffer: Buffer
    logger: LoggerNode
    seed: Annotated[int, Range(ge=0)]
    device: str
    dtype: str
    num_threads: int | None
    output_dir: str
    overwrite: bool
    metric: str
    generation: Generation
    labeler: Any  # a _target_ node: the labeler of generated responses
    margin_in_loss: bool
    # trl.RewardConfig's own fields (check_reward_config_keys), plus its _target_.
    train: Annotated[dict[str, Any], OPEN]
    eval: Eval


def check_reward_config_keys(train: DictConfig) -> None:
    """Refuses a ``train:`` key that ``trl.RewardConfig`` does not have (naming the nearest ones), and the keys the
    recipe decides itself (``report_to``: the run's ``logger=``; ``use_cpu``: its ``device``)."""
    from trl import RewardConfig  # trl prints a notice on import: only where the reward recipe runs

    check_trainer_config_keys(train, RewardConfig)
