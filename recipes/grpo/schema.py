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

import logging
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from recipes.common.rollout_backend import RolloutBackendName
from recipes.common.schema import (
    OPEN,
    Aliases,
    DataNode,
    DType,
    Hint,
    LoggerNode,
    MaxGradNorm,
    ModelNode,
    NumThreads,
    Range,
    RayNode,
    RewardFunctions,
    ToolsNode,
    WorkerResourcesNode,
)
from recipes.common.vocabulary import SHARED_KEYS_OF_TRL_FIELDS
from recipes.grpo.rollout_envs import ROLLOUT_ENVS, RolloutEnvName

log = logging.getLogger(__name__)

__all__ = [
    "RENAMED",
    "TRL_NAMES",
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
    "SamplerCorrection",
    "SamplerCorrectionMode",
    "Sapo",
    "ScaleRewards",
    "Strategy",
    "Vespo",
]

# Keys of earlier versions: what replaced each (a config that still sets one is refused, saying so).
RENAMED = {"loss.aggregation": "loss.type (aggregation=token_mean is loss.type=bnpo, prompt_mean is loss.type=grpo)"}

# trl.GRPOConfig's names -> this recipe's keys: a config key of trl's name (`+loss.beta=0.1`, `+num_generations=4`),
# wherever it is written, is refused naming the key that does what trl's does (recipes.common.schema's `aliases`).
TRL_NAMES = Aliases(
    "trl.GRPOConfig",
    {
        **SHARED_KEYS_OF_TRL_FIELDS,  # the keys the trl recipe reads too
        "beta": "loss.kl_to_ref_coeff",
        "loss_type": "loss.type",
        "epsilon": "loss.clip_epsilon",
        "epsilon_high": "loss.clip_epsilon_high",
        "delta": "loss.delta",
        "importance_sampling_level": "loss.importance_sampling_level",
        "use_bias_correction_kl": "loss.kl_bias_correction",
        "entropy_coef": "loss.entropy_coeff",
        "top_entropy_quantile": "loss.top_entropy_quantile",
        "mask_truncated_completions": "loss.mask_truncated_completions",
        "off_policy_mask_threshold": "loss.off_policy_mask_threshold",
        "vllm_importance_sampling_correction": "loss.sampler_correction.enabled",
        "vllm_importance_sampling_mode": "loss.sampler_correction.mode",
        "vllm_importance_sampling_clip_min": "loss.sampler_correction.clip_min",
        "vllm_importance_sampling_clip_max": "loss.sampler_correction.clip_max",
        "sync_ref_model": "loss.sync_ref_model",
        "ref_model_mixup_alpha": "loss.ref_model_mixup_alpha",
        "ref_model_sync_steps": "loss.ref_model_sync_steps",
        "sapo_temperature_pos": "loss.sapo.temperature_pos",
        "sapo_temperature_neg": "loss.sapo.temperature_neg",
        "vespo_k_pos": "loss.vespo.k_pos",
        "vespo_lambda_pos": "loss.vespo.lambda_pos",
        "vespo_k_neg": "loss.vespo.k_neg",
        "vespo_lambda_neg": "loss.vespo.lambda_neg",
        "scale_rewards": "advantage.scale_rewards",
        "generation_batch_size": "rollout.responses_per_step",
        "reward_weights": "reward.functions.<name>.weight (and reward.model_weight for the reward model)",
        "num_generations_eval": "eval.group_size",
        "eval_steps": "eval.every_n_steps",
        "learning_rate": "optimizer.lr",
        "weight_decay": "optimizer.weight_decay",
        "adam_beta1": "optimizer.betas (a pair [beta1, beta2])",
        "adam_beta2": "optimizer.betas (a pair [beta1, beta2])",
        "optim": "optimizer._target_ and optimizer.fused (adamw_torch_fused: torch.optim.AdamW, fused=true)",
        "max_steps": "train.steps",
        "num_iterations": "train.epochs_per_step",
        "per_device_train_batch_size": "train.mini_batch_size",
        "steps_per_generation": (
            "train.mini_batch_size (mini-batches per generation = rollout.responses_per_step / train.mini_batch_size)"
        ),
        "gradient_accumulation_steps": "train.gradient_accumulation_steps",
        "lr_scheduler_type": "train.lr_scheduler",
        "warmup_steps": "train.warmup_steps",
        "max_grad_norm": "train.max_grad_norm",
        "gradient_checkpointing": "train.gradient_checkpointing",
        "bf16": "train.mixed_precision=bf16 (bfloat16 autocast over float32 weights), or dtype=bfloat16",
        "save_steps": "checkpoint.every_n_steps",
        "save_total_limit": "checkpoint.keep_last",
        "logging_steps": "log_every_n_steps",
        "log_completions": "samples.every_n_steps",
        "num_completions_to_print": "samples.print_count",
        "resume_from_checkpoint": "resume",
    },
)

Positive = Annotated[int, Range(ge=1)]
NonNegative = Annotated[int, Range(ge=0)]

# trl's loss_type menu, in trl's order: the names of recipes.grpo.loss.LOSS_RULES (a test holds them equal).
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
# trl's vllm_importance_sampling_mode menu: a ratio per token or per response, clipped (truncate) or zeroed (mask).
SamplerCorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
ScaleRewards = Literal["group", "batch", "none"]
RewardAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
# prompt: PromptEnv + CausalLMSampler; chat: TorchRL's ChatEnv + TransformersWrapper: the names of
# recipes.grpo.rollout_envs.ROLLOUT_ENVS, the table of what each honours.
RolloutEnv = RolloutEnvName
RolloutMode = Literal["sync", "async"]
# What the reward model reads (recipes.grpo.rewards).
RewardInput = Literal["history", "text", "tokens"]
# transformers' get_scheduler names that take no extra settings.
LrScheduler = Literal[
    "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt"
]
# The ones that apply train.warmup_steps (get_scheduler hands "constant" none).
WARMUP_SCHEDULERS = tuple(name for name in typing.get_args(LrScheduler) if name != "constant")
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
    past_lag_bound: Literal["withhold", "resample"]  # interop.trl.rollout_func.PAST_LAG_BOUND
    # Where training batches are sampled (recipes.common.rollout_backend); null: the mode's default.
    backend: RolloutBackendName | None
    workers: Positive
    worker_resources: WorkerResourcesNode
    collector_threads: Positive
    learner_sampling_threads: Positive | None  # null: num_threads
    # Apart from the learner: push the weights every this many updates; the samplers' dtype.
    weight_sync_every: Positive
    sampler_dtype: DType  # the same choices as dtype (float16: CUDA only, as dtype)
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
    # With tools: assistant turns per dialog (trl's max_tool_calling_iterations + 1).
    max_turns: Positive

    def __post_init__(self) -> None:
        if self.responses_per_step % self.group_size:
            whole = max(1, self.responses_per_step // self.group_size) * self.group_size
            raise ValueError(
                f"responses_per_step={self.responses_per_step} is not a multiple of group_size={self.group_size}: "
                f"every prompt gets a full group. Use a multiple, e.g. responses_per_step={whole}."
            )
        if self.mode == "async" and not ROLLOUT_ENVS[self.env].runs_apart:
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
    share_prompt: bool
    model_weight: int | float  # as written: reward.model_weight=0 is refused quoting 0 (reward_functions)
    # name -> {function, weight}: the names are the user's, each entry a RewardFunctionNode.
    functions: RewardFunctions
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
    # A reward source's name (recipes.grpo.evaluation.accuracy_source), or null.
    accuracy_source: str | None


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
class SamplerCorrection:
    """``loss.sampler_correction``: trl's ``vllm_importance_sampling_*`` for the recipe's sampler
    (``recipes.grpo.loss.sampler_correction_ratio``)."""

    enabled: bool
    mode: Annotated[
        SamplerCorrectionMode,
        Hint("{key}={value} is not one of trl's modes: expected one of {choices} (vllm_importance_sampling_mode)."),
    ]
    # null: no bound on that side.
    clip_min: Annotated[float, Range(ge=0)] | None
    clip_max: Annotated[float, Range(gt=0)] | None

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        if self.clip_min is not None and self.clip_max is not None and self.clip_min >= self.clip_max:
            raise ValueError(
                f"clip_min={self.clip_min} is not below clip_max={self.clip_max}: the ratios kept would be an empty "
                "range. Set clip_min below clip_max (trl's defaults: clip_min=null, clip_max=3.0)."
            )
        if self.mode.endswith("_truncate") and self.clip_min is None and self.clip_max is None:
            raise ValueError(
                f"clip_max=null with clip_min=null: mode={self.mode} clips the ratio into [clip_min, clip_max] and "
                "needs one bound at least (trl's default clip_max is 3.0)."
            )


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
    # trl's range: 0 keeps the highest-entropy token(s) of the mini-batch alone, 1 every token.
    top_entropy_quantile: Annotated[float, Range(ge=0, le=1)]
    mask_truncated_completions: bool
    off_policy_mask_threshold: Annotated[float, Range(ge=0)] | None
    sync_ref_model: bool
    ref_model_mixup_alpha: Annotated[float, Range(ge=0, le=1)]
    ref_model_sync_steps: Positive
    sapo: Sapo
    vespo: Vespo
    sampler_correction: SamplerCorrection

    def __post_init__(self) -> None:
        if self.type == "cispo" and self.clip_epsilon_high is None and not isinstance(self.clip_epsilon, list):
            # Said as the node is built from the YAML (built, clip_epsilon_high holds the bound the loss takes).
            log.warning(
                "loss.type=cispo clamps the importance ratio itself at loss.clip_epsilon_high, which is null: it "
                "takes loss.clip_epsilon=%s, as trl does, and clamps every ratio below 1. Set loss.clip_epsilon_high "
                "(1.28 learns the tiny task; ScaleRL's 4 collapsed it at step 29).",
                self.clip_epsilon,
            )
        self.clip_epsilon, self.clip_epsilon_high = self._clip_range()
        correction = self.sampler_correction
        if correction.enabled and self.type == "vespo" and correction.mode.startswith("sequence_"):
            raise ValueError(
                f"sampler_correction.mode={correction.mode} with type=vespo: VESPO weighs each response by its "
                "sequence ratio itself and takes a per-token correction only (trl refuses it too); use "
                "sampler_correction.mode=token_truncate or token_mask."
            )
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
    fused: bool


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
    warmup_steps: (
        Annotated[int, Range(ge=0)]
        | Annotated[
            float,
            Range(ge=0, lt=1),
            Hint(
                "{key}={value}: a fraction of the optimizer steps must be below 1 (e.g. {key}=0.1); write a number of "
                "steps as a whole number (e.g. {key}=2)."
            ),
        ]
    )
    max_grad_norm: MaxGradNorm
    gradient_checkpointing: bool
    mixed_precision: MixedPrecision
    share_prompt: bool
    max_tokens_per_micro_batch: Positive | None

    def __post_init__(self) -> None:
        if self.warmup_steps and self.lr_scheduler not in WARMUP_SCHEDULERS:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} with lr_scheduler={self.lr_scheduler}: that schedule has no warm-up "
                f"(transformers' get_scheduler ignores it), so the warm-up would silently not happen. Use a schedule "
                f"that warms up ({', '.join(WARMUP_SCHEDULERS)}; trl's default is linear), e.g. "
                "lr_scheduler=constant_with_warmup, or warmup_steps=0."
            )


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
    ray: RayNode
    # timeout_s and max_result_tokens, then <name>: {function} and <label>: {torchrl | mcp} entries, whose names are the
    # user's (recipes.common.tools checks each entry, recipes.grpo.checks the combinations).
    tools: ToolsNode
    reward: Reward
    eval: Eval
    advantage: Advantage
    loss: Loss
    optimizer: Optimizer
    train: Train
    checkpoint: Checkpoint
    distributed: Distributed
    summary: Summary
