"""The keys ``conf/grpo_torchrl_rm.yaml`` may hold and what each may be (``recipes.common.schema``): a key the recipe
does not read, a wrong type, a non-finite number or a value out of range is refused before anything loads. Defaults
live in the YAML, not here; rules that cross keys live in ``recipes.grpo.checks``.

Dependencies: the project's ``recipes.common.schema``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from recipes.common.schema import OPEN, DataNode, LoggerNode, ModelNode, Range

__all__ = ["RENAMED", "GRPORecipeConfig"]

# Keys of earlier versions: what replaced each (a config that still sets one is refused, saying so).
RENAMED = {"loss.aggregation": "loss.type (aggregation=token_mean is loss.type=bnpo, prompt_mean is loss.type=grpo)"}

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
    # The settings of the sampler rollout.env picks (recipes.grpo.collector.check_generation_settings checks the keys).
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
    model_weight: float
    # name -> {function, weight}: the names are the user's (recipes.common.reward_functions checks each node).
    functions: Annotated[dict[str, Any], OPEN]
    # name -> a _target_ node building a TensorDict reward term (and its weight): the names are the user's.
    terms: Annotated[dict[str, Any], OPEN]
    aggregation: Literal["sum_then_normalize", "normalize_then_sum"]


@dataclass
class Eval:
    every_n_steps: Positive | None
    num_prompts: Positive | None
    group_size: Positive
    # Sampler settings over rollout.generation's (recipes.grpo.evaluation.check_eval_settings checks the keys).
    generation: Annotated[dict[str, Any], OPEN]


@dataclass
class Advantage:
    scale_rewards: Literal["group", "batch", "none"]
    filter_zero_std_groups: bool
    max_extra_batches: NonNegative


@dataclass
class Sapo:
    temperature_pos: Annotated[float, Range(gt=0)]
    temperature_neg: Annotated[float, Range(gt=0)]


@dataclass
class Vespo:
    k_pos: float
    lambda_pos: float
    k_neg: float
    lambda_neg: float


@dataclass
class Loss:
    type: str
    importance_sampling_level: Literal["token", "sequence"]
    # A number, or TorchRL's [low, high] pair.
    clip_epsilon: Annotated[float, Range(gt=0)] | list[Annotated[float, Range(gt=0)]]
    clip_epsilon_high: Annotated[float, Range(gt=0)] | None
    delta: Annotated[float, Range(gt=1)] | None
    kl_to_ref_coeff: Annotated[float, Range(ge=0)] | None
    kl_bias_correction: bool
    entropy_coeff: float
    top_entropy_quantile: Annotated[float, Range(gt=0, le=1)]
    mask_truncated_completions: bool
    off_policy_mask_threshold: Annotated[float, Range(ge=0)] | None
    sync_ref_model: bool
    ref_model_mixup_alpha: Annotated[float, Range(ge=0, le=1)]
    ref_model_sync_steps: Positive
    sapo: Sapo
    vespo: Vespo


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
    gradient_accumulation_steps: Positive
    lr_scheduler: str
    # A number of optimizer steps, or a float in [0, 1): that fraction of them.
    warmup_steps: Annotated[int, Range(ge=0)] | Annotated[float, Range(ge=0, lt=1)]
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
class GRPORecipeConfig:
    """``conf/grpo_torchrl_rm.yaml`` with its groups (``model``, ``reward_model``, ``data``, ``logger``)."""

    model: ModelNode
    reward_model: ModelNode | None
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
    eval: Eval
    advantage: Advantage
    loss: Loss
    optimizer: Optimizer
    train: Train
    checkpoint: Checkpoint
    distributed: Distributed
    summary: Summary
