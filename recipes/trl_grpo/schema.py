"""The keys ``conf/trl_grpo_torchrl_rollouts.yaml`` may hold and what each may be (``recipes.common.schema``): a key
the recipe does not read, a wrong type, a non-finite number or a value out of range is refused before anything loads.
``train:`` is a ``trl.GRPOConfig``: its keys are checked against trl's own fields
(``recipes.common.schema.check_trainer_config_keys``). Defaults live in the YAML (and trl's), not here; rules that
cross keys live in ``recipes.trl_grpo.checks``.

Dependencies: the project's ``recipes.common.schema``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from recipes.common.schema import OPEN, DataNode, LoggerNode, ModelNode, Range

__all__ = ["RENAMED", "TrlGRPORecipeConfig"]

Positive = Annotated[int, Range(ge=1)]

# Keys of earlier versions: what replaced each (a config that still sets one is refused, saying so).
RENAMED = {
    "rollouts.max_rows": "rollout.store.max_rows",
    "rollouts.max_text_bytes": "rollout.store.max_text_bytes",
}


@dataclass
class RolloutStore:
    """Where every completion trl trains on is kept (``recipes.trl_grpo.rollout_store``)."""

    max_rows: Positive
    max_text_bytes: Positive


@dataclass
class Rollout:
    """How rollouts are made and kept: the prompt stream TorchRL samples for, and the store of what trl trained on
    (the sampling settings are trl's own, under ``train:``)."""

    prompts_per_draw: Positive
    store: RolloutStore


@dataclass
class Reward:
    model_weight: float
    # name -> {function, weight}: the names are the user's (recipes.common.reward_functions checks each node).
    functions: Annotated[dict[str, Any], OPEN]


@dataclass
class TrlGRPORecipeConfig:
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
    # trl.GRPOConfig's own fields (checked against trl's), plus its _target_.
    train: Annotated[dict[str, Any], OPEN]
