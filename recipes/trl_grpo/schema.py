"""The keys ``conf/trl_grpo_torchrl_rollouts.yaml`` may hold and what each may be (``recipes.common.schema``): a key
the recipe does not read, a wrong type, a non-finite number or a value out of range is refused before anything loads.
``train:`` is a ``trl.GRPOConfig``: its keys are checked against trl's own fields, and those of
:class:`GRPOTrainerNode` against their ranges and choices over trl's defaults
(``recipes.common.schema.checked_trainer_config``). Defaults live in the YAML (and trl's), not here; rules that cross
keys live in ``recipes.trl_grpo.checks``.

Dependencies: the project's ``recipes.common.schema``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from recipes.common.schema import OPEN, DataNode, DType, Hint, LoggerNode, ModelNode, NumThreads, Range, TrainerNode

__all__ = ["RENAMED", "GRPOTrainerNode", "TrlGRPORecipeConfig"]

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
    dtype: DType
    num_threads: NumThreads
    output_dir: str
    metric: str
    resume: bool
    overwrite: bool
    system_prompt: str | None
    rollout: Rollout
    reward: Reward
    # trl.GRPOConfig's own fields (checked against trl's; GRPOTrainerNode's over trl's defaults), plus its _target_.
    train: Annotated[dict[str, Any], OPEN]


# This recipe hands trl no eval_dataset: its rollout store and figures would take evaluation batches for training ones.
_NO_EVAL = Hint(
    "{key}={value}: this recipe hands trl no eval_dataset yet (its rollout store and figures would take evaluation "
    "batches for training ones). Drop train.eval_strategy and train.do_eval; held-out evaluation of a GRPO policy: "
    "recipes/grpo_torchrl_rm.py eval.every_n_steps=N."
)


@dataclass
class GRPOTrainerNode(TrainerNode):
    """The ``trl.GRPOConfig`` fields this recipe relies on (beyond every trl recipe's), over trl's defaults."""

    eval_strategy: Annotated[Literal["no"], _NO_EVAL]
    do_eval: Annotated[Literal[False], _NO_EVAL]
    use_vllm: Annotated[
        Literal[False],
        Hint(
            "{key}={value}: this recipe's completions come from TorchRL (interop.TorchRLRolloutFunc), not vLLM; drop "
            "{key} (or use trl's own GRPOTrainer for vLLM generation)."
        ),
    ]
