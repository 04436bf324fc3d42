"""The keys ``conf/grpo_torchrl_rm.yaml`` may hold and what each may be (``recipes.common.schema``): a key the recipe
does not read, a wrong type, a non-finite number or a value out of range is refused before anything loads. Defaults
live in the YAML, not here; rules that cross keys live in ``recipes.grpo.checks``.

Dependencies: the project's ``recipes.common.schema``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from recipes.common.schema import OPEN, DataNode, LoggerNode, ModelNode, Range

__all__ = ["GRPOConfig"]

Positive = Annotated[int, Range(ge=1)]
NonNegative = Annotated[int, Range(ge=0)]


@dataclass
class Samples:
    every_n_steps: int | None
    log_count: int
    print_count: int


@dataclass
class Rollout:
    env: str
    mode: str
    max_policy_lag: int
    collector_threads: int
    group_size: int
    responses_per_step: int
    system_prompt: str | None
    # The settings of the sampler rollout.env picks (recipes.grpo.rollout.check_generation_settings checks the keys).
    generation: Annotated[dict[str, Any], OPEN]
    log_prob_micro_batch_size: Positive | None


@dataclass
class ReadKeys:
    history: str | list[str]
    text: str | list[str]
    tokens: str | list[str]
    attention_mask: str | list[str]


@dataclass
class Reward:
    input: str
    read_keys: ReadKeys
    micro_batch_size: Positive | None
    max_length: Positive | None
    # name -> a _target_ node building a TensorDict reward term: the names are the user's.
    terms: Annotated[dict[str, Any], OPEN]


@dataclass
class Loss:
    clip_epsilon: Annotated[float, Range(gt=0)]
    entropy_coeff: float
    kl_to_ref_coeff: float | None
    aggregation: str


@dataclass
class Optimizer:
    _target_: str
    _partial_: Literal[True]
    lr: float
    betas: list[Annotated[float, Range(ge=0, lt=1)]]
    weight_decay: Annotated[float, Range(ge=0)]


@dataclass
class Train:
    steps: int
    epochs_per_step: int
    mini_batch_size: int
    max_grad_norm: float | None
    gradient_checkpointing: bool
    mixed_precision: str


@dataclass
class Checkpoint:
    every_n_steps: int | None
    keep_last: int | None
    save_merged: bool


@dataclass
class Distributed:
    backend: str
    strategy: str


@dataclass
class Summary:
    window: int


@dataclass
class GRPOConfig:
    """``conf/grpo_torchrl_rm.yaml`` with its groups (``model``, ``reward_model``, ``data``, ``logger``)."""

    model: ModelNode
    reward_model: ModelNode
    data: DataNode
    logger: LoggerNode
    seed: NonNegative
    device: str
    dtype: str
    output_dir: str
    metric: str
    resume: bool
    resume_allow_changes: list[str]
    overwrite: bool
    num_threads: int | None
    progress_bar: bool
    log_every_n_steps: int
    samples: Samples
    rollout: Rollout
    reward: Reward
    loss: Loss
    optimizer: Optimizer
    train: Train
    checkpoint: Checkpoint
    distributed: Distributed
    summary: Summary
