"""The keys ``conf/grpo_torchrl_rm.yaml`` may hold, what each may be, and the rules within each node
(``recipes.common.schema``): a key the recipe does not read, a wrong type, a non-finite number, a value out of range or
not one of its choices, or a node whose keys disagree is refused before anything loads. Defaults live in the YAML, not
here; rules that cross nodes live in ``recipes.grpo.checks``.

The choices are ``Literal`` types, which the modules that act on them read (``typing.get_args``): :data:`LossType`,
:data:`ScaleRewards`, :data:`ImportanceSamplingLevel`, :data:`RewardAggregation` (``recipes.grpo.loss``),
:data:`MixedPrecision` (``recipes.grpo.policy``), :data:`Strategy` (``recipes.grpo.distributed``), :data:`RewardInput`
(what ``reward.input`` may be). The :class:`Loss` node is what the loss reads (``recipes.grpo.loss.GRPOObjective``).

Dependencies: the project's ``recipes.common.schema``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from recipes.common.schema import (
    OPEN,
    DataNode,
    DType,
    Hint,
    LoggerNode,
    MaxGradNorm,
    ModelNode,
    NumThreads,
    Range,
)

__all__ = [
    "RENAMED",
    "Advantage",
    "Backend",
    "GRPORecipeConfig",
    "ImportanceSamplingLevel",
    "Loss",
    "LossType",
    "MixedPrecision",
    "RewardAggregation",
    "RewardInput",
    "Rollout",
    "RolloutEnv",
    "RolloutMode",
    "Sapo",
    "ScaleRewards",
    "Strategy",
    "Vespo",
]

# Keys of earlier versions: what replaced each (a config that still sets one is refused, saying so).
RENAMED = {"loss.aggregation": "loss.type (aggregation=token_mean is loss.type=bnpo, prompt_mean is loss.type=grpo)"}

Positive = Annotated[int, Range(ge=1)]
NonNegative = Annotated[int, Range(ge=0)]

# trl's loss_type menu, in trl's order (recipes.grpo.loss.POLICY_LOSSES has one rule per name).
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
ScaleRewards = Literal["group", "batch", "none"]
RewardAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
# prompt: PromptEnv + CausalLMSampler; chat: TorchRL's ChatEnv + TransformersWrapper (recipes.grpo.collector).
RolloutEnv = Literal["prompt", "chat"]
RolloutMode = Literal["sync", "async"]
# What the reward model reads (recipes.grpo.rewards).
RewardInput = Literal["history", "text", "tokens"]
# transformers' get_scheduler names that take no extra settings.
LrScheduler = Literal[
    "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt"
]
# "no": the loss forward in the weights' dtype; "bf16": under bfloat16 autocast (recipes.grpo.policy).
MixedPrecision = Literal["no", "bf16"]
Backend = Literal["auto", "gloo", "nccl"]
# ddp: every process holds the whole policy and its optimizer state; fsdp: 1/N of them each (FSDP2).
Strategy = Literal["ddp", "fsdp"]
# What restore_progress and the optimizer node know how to set: Adam's family.
OptimizerTarget = Literal["torch.optim.AdamW", "torch.optim.Adam"]


def _at_least_once(what: str) -> Hint:
    return Hint("{key}={value} must be >= 1, or null " + what + ".")


@dataclass
class Samples:
    every_n_steps: Annotated[int | None, Range(ge=1), _at_least_once("for no samples")]
    log_count: NonNegative
    print_count: NonNegative


# What GRPO needs of any sampler's settings (rollout.generation is open: its keys are the sampler's, rollout.env's).
_SAMPLING_KEYS = ("max_new_tokens", "do_sample", "temperature")


@dataclass
class Rollout:
    env: RolloutEnv
    mode: RolloutMode
    max_policy_lag: NonNegative
    collector_threads: Positive
    group_size: Annotated[
        int,
        Range(ge=2),
        Hint(
            "{key}={value}: GRPO normalises each reward against the other responses to the same prompt, so a group "
            "needs at least 2 responses; set {key} >= 2."
        ),
    ]
    responses_per_step: Positive
    system_prompt: str | None
    # The settings of the sampler rollout.env picks (recipes.grpo.checks checks the keys against it).
    generation: Annotated[dict[str, Any], OPEN]
    log_prob_micro_batch_size: Positive | None

    def __post_init__(self) -> None:
        if self.responses_per_step % self.group_size:
            whole = max(1, self.responses_per_step // self.group_size) * self.group_size
            raise ValueError(
                f"responses_per_step={self.responses_per_step} is not a multiple of group_size={self.group_size}: "
                f"every prompt gets a full group. Use a multiple, e.g. responses_per_step={whole}."
            )
        if self.mode == "async" and self.env != "prompt":
            raise ValueError(
                f"mode=async runs the collector of env=prompt in a background process; env={self.env} collects in "
                "the learner's process only. Use env=prompt, or mode=sync."
            )
        _check_grpo_sampling(self.generation)


def _check_grpo_sampling(generation: dict) -> None:
    """What GRPO needs of its samples, whichever sampler draws them: diverse responses within a group."""
    missing = [name for name in _SAMPLING_KEYS if name not in generation]
    if missing:
        raise ValueError(f"generation.{missing[0]} is missing: GRPO reads it. Restore it in the YAML.")
    if generation["max_new_tokens"] < 1:
        raise ValueError(f"generation.max_new_tokens={generation['max_new_tokens']} must be >= 1.")
    if not generation["do_sample"]:
        raise ValueError(
            "generation.do_sample=false: greedy decoding gives every response to a prompt the same text and reward, "
            "so GRPO's group-normalised advantages are all 0 and nothing is learned. Sample "
            "(generation.do_sample=true, with a temperature > 0)."
        )
    if generation["temperature"] <= 0:
        raise ValueError(
            f"generation.temperature={generation['temperature']} must be > 0 when sampling; GRPO needs diverse "
            "responses within a group."
        )


@dataclass
class ReadKeys:
    history: str | list[str]
    text: str | list[str]
    tokens: str | list[str]
    attention_mask: str | list[str]


@dataclass
class Reward:
    input: RewardInput
    read_keys: ReadKeys
    micro_batch_size: Positive | None
    max_length: Positive | None
    model_weight: float
    # name -> {function, weight}: the names are the user's (recipes.common.reward_functions checks each node).
    functions: Annotated[dict[str, Any], OPEN]
    # name -> a _target_ node building a TensorDict reward term (and its weight): the names are the user's.
    terms: Annotated[dict[str, Any], OPEN]
    aggregation: RewardAggregation


@dataclass
class Eval:
    every_n_steps: Positive | None
    num_prompts: Positive | None
    group_size: Positive
    # Sampler settings over rollout.generation's (recipes.grpo.evaluation.check_eval_settings checks the keys).
    generation: Annotated[dict[str, Any], OPEN]


@dataclass
class Advantage:
    scale_rewards: ScaleRewards
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
    """``loss:`` as the loss reads it (``recipes.grpo.loss.GRPOObjective``; trl's ``GRPOConfig`` names in the YAML's
    comments). Built, the clip range is two numbers: ``clip_epsilon`` the lower one, ``clip_epsilon_high`` the upper
    one, whether the YAML wrote TorchRL's ``[low, high]`` pair or a number with ``clip_epsilon_high`` null (the same).
    """

    type: Annotated[LossType, Hint("{key}={value}: expected one of {choices} (trl's loss_type).")]
    importance_sampling_level: ImportanceSamplingLevel
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

    def __post_init__(self) -> None:
        self.clip_epsilon, self.clip_epsilon_high = self._clip_range()
        if self.sync_ref_model and not self.kl_to_ref_coeff:
            raise ValueError(
                "sync_ref_model=true with no KL term (kl_to_ref_coeff=0 or null): there is no reference to keep in "
                "sync. Set a KL coefficient, or sync_ref_model=false."
            )

    def _clip_range(self) -> tuple[float, float]:
        if not isinstance(self.clip_epsilon, (list, tuple)):
            high = self.clip_epsilon if self.clip_epsilon_high is None else self.clip_epsilon_high
            return float(self.clip_epsilon), float(high)
        if len(self.clip_epsilon) != 2 or self.clip_epsilon_high is not None:
            raise ValueError(
                f"clip_epsilon={list(self.clip_epsilon)}: a list is TorchRL's (low, high) pair, two numbers, with "
                "clip_epsilon_high=null; or give clip_epsilon=<low> clip_epsilon_high=<high>."
            )
        low, high = self.clip_epsilon
        return float(low), float(high)


@dataclass
class Optimizer:
    _target_: Annotated[
        OptimizerTarget,
        Hint(
            "{key}={value}: the recipe trains with {choices} (their lr, betas and weight_decay are what its config "
            "holds and a resume restores); use one of them."
        ),
    ]
    _partial_: Literal[True]
    lr: Annotated[
        float,
        Range(gt=0, le=1),
        Hint(
            "{key}={value}: an Adam step moves every weight by about lr, so lr must be a number in (0, 1]: above 1 "
            "the weights blow up (past 3.4e38 they overflow float32). Use 1e-6 to 1e-3 for real models."
        ),
    ]
    betas: list[Annotated[float, Range(ge=0, lt=1)]]
    weight_decay: Annotated[float, Range(ge=0)]


@dataclass
class Train:
    steps: Positive
    epochs_per_step: Positive
    mini_batch_size: Positive
    gradient_accumulation_steps: Positive
    lr_scheduler: Annotated[
        LrScheduler,
        Hint("{key}={value}: expected one of {choices} (transformers' schedules that need no more settings)."),
    ]
    # A number of optimizer steps, or a float in [0, 1): that fraction of them.
    warmup_steps: Annotated[int, Range(ge=0)] | Annotated[float, Range(ge=0, lt=1)]
    max_grad_norm: MaxGradNorm
    gradient_checkpointing: bool
    mixed_precision: MixedPrecision


@dataclass
class Checkpoint:
    every_n_steps: Annotated[int | None, Range(ge=1), _at_least_once("to save only at the end")]
    keep_last: Annotated[int | None, Range(ge=1), _at_least_once("to keep all")]
    save_merged: bool


@dataclass
class Distributed:
    backend: Backend
    strategy: Strategy


@dataclass
class Summary:
    window: Positive


@dataclass
class GRPORecipeConfig:
    """``conf/grpo_torchrl_rm.yaml`` with its groups (``model``, ``reward_model``, ``data``, ``logger``)."""

    model: ModelNode
    reward_model: ModelNode | None
    data: DataNode
    logger: LoggerNode
    seed: NonNegative
    device: str
    dtype: DType
    output_dir: str
    metric: str
    resume: bool
    resume_allow_changes: list[str]
    overwrite: bool
    num_threads: NumThreads
    progress_bar: bool
    log_every_n_steps: Positive
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
