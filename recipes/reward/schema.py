"""The keys ``conf/reward_trainer_from_buffer.yaml`` may hold, what each may be, and the rules within each node
(``recipes.common.schema``): a key the recipe does not read, a wrong type, a non-finite number, a value out of range
or not one of its choices, or a node whose keys disagree is refused before anything loads. ``train:`` is
``trl.RewardConfig``: its keys are checked against trl's own fields, and the ones the recipe relies on against their
ranges over trl's defaults (:func:`reward_trainer_config`). Defaults live in the YAML (and trl's), not here; rules
that cross nodes live in ``recipes.reward.checks``.

Dependencies: the project's ``recipes.common.schema``; ``trl`` for the ``train:`` keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from recipes.common.schema import (
    DATA_SOURCES,
    OPEN,
    ArithmeticData,
    CalculatorData,
    DType,
    Hint,
    LoggerNode,
    ModelNode,
    NumThreads,
    Range,
    Variant,
    checked_trainer_config,
    trainer_config_view,
)

__all__ = [
    "Buffer",
    "Eval",
    "PairKeys",
    "RewardRecipeConfig",
    "Storage",
    "checked_reward_trainer_config",
    "reward_trainer_view",
]

Positive = Annotated[int, Range(ge=1)]
Key = str | list[str]
# lazy_tensor: in memory; memmap: written to buffer.path (recipes.reward.buffer).
Storage = Literal["lazy_tensor", "memmap"]


@dataclass
class NoPairsData(ArithmeticData):
    """``data=arithmetic`` here: prompts with a solution a reward function checks, no preference pairs to train on."""

    def __post_init__(self) -> None:
        raise ValueError(
            "data=arithmetic is a GRPO task (prompts with a solution checked by a reward function): it has no "
            "preference pairs to train a reward model on. Use data=synthetic, data=file or data=hf."
        )


@dataclass
class NoPairsCalculatorData(CalculatorData):
    """``data=calculator`` here: tool-use prompts with a solution, no preference pairs to train on."""

    def __post_init__(self) -> None:
        raise ValueError(
            "data=calculator is a GRPO task (tool-use prompts with a solution checked by a reward function): it has "
            "no preference pairs to train a reward model on. Use data=synthetic, data=file or data=hf."
        )


# The data a reward model trains on: every source but the GRPO-only ones.
PairData = Annotated[
    dict, Variant("source", {**DATA_SOURCES, "arithmetic": NoPairsData, "calculator": NoPairsCalculatorData})
]


@dataclass
class Generation:
    responses_per_prompt: Annotated[
        int,
        Range(ge=2),
        Hint("{key}={value}: a preference pair needs two responses to the same prompt; use 2 or more."),
    ]
    prompts_per_batch: Positive
    # Any transformers GenerationConfig field (recipes.common.chat.check_chat_generation_settings checks the keys).
    generate_kwargs: Annotated[dict[str, Any], OPEN]


@dataclass
class Eval:
    holdout_fraction: Annotated[float, Range(gt=0, lt=1)]
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
    storage: Annotated[Storage, Hint("{key}={value}: expected one of {choices} (buffer=memmap ...).")]
    path: str | None
    load_from: str | None
    sampler: Any  # a _target_ node: a TorchRL sampler
    pair_keys: PairKeys

    def __post_init__(self) -> None:
        if self.storage == "memmap" and self.path is None:
            raise ValueError(
                "storage=memmap writes its pairs to a folder, but path=null: set path=<folder> (buffer=memmap sets "
                "it to the run folder's buffer/)."
            )


@dataclass
class RewardRecipeConfig:
    """``conf/reward_trainer_from_buffer.yaml`` with its groups (``model``, ``reward_model``, ``data``, ``buffer``,
    ``logger``)."""

    model: ModelNode
    reward_model: ModelNode
    data: PairData
    buffer: Buffer
    logger: LoggerNode
    seed: Annotated[int, Range(ge=0)]
    device: str
    dtype: DType
    num_threads: NumThreads
    output_dir: str
    overwrite: bool
    metric: str
    generation: Generation
    labeler: Any  # a _target_ node: the labeler of generated responses
    margin_in_loss: bool
    # trl.RewardConfig's own fields (checked_reward_trainer_config), plus its _target_.
    train: Annotated[dict[str, Any], OPEN]
    eval: Eval


def checked_reward_trainer_config(train: Mapping) -> SimpleNamespace:
    """``train:`` as ``trl.RewardConfig`` will read it, once checked: no key ``RewardConfig`` lacks (the nearest ones
    named), none the recipe decides itself (``report_to``: the run's ``logger=``; ``use_cpu``: its ``device``), and the
    fields of ``recipes.common.schema.TrainerNode`` in range over trl's defaults."""
    from trl import RewardConfig  # trl prints a notice on import: only where the reward recipe runs

    return checked_trainer_config(train, RewardConfig)


def reward_trainer_view(train: Mapping) -> SimpleNamespace:
    """``train:`` as ``trl.RewardConfig`` will read it (trl's defaults under the config's values), before it is built:
    what the recipe reads of trl's settings, so that a key the YAML leaves to trl reads as trl's default."""
    from trl import RewardConfig

    return trainer_config_view(train, RewardConfig)
