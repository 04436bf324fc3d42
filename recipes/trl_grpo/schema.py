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

from recipes.common.rollout_backend import RolloutBackendName
from recipes.common.schema import (
    OPEN,
    DataNode,
    DType,
    Hint,
    LoggerNode,
    ModelNode,
    NumThreads,
    Range,
    RayNode,
    RewardFunctions,
    ToolsNode,
    TrainerNode,
    WorkerResourcesNode,
)
from recipes.common.vocabulary import SHARED_KEYS_OF_TRL_FIELDS

__all__ = ["GRPO_CONFIG_FIELDS", "RENAMED", "Generation", "GRPOTrainerNode", "TrlGRPORecipeConfig"]

Positive = Annotated[int, Range(ge=1)]
# A number kept as written (temperature=0 stays 0): trl gets it as the GRPO recipe's sampler does, and a refusal
# (interop.SamplingSettings') quotes the value the user gave.
Number = int | float

# trl.GRPOConfig's fields that this recipe sets from its own keys, the GRPO recipe's (one key per setting in both
# recipes): field -> the key read (recipes.trl_grpo.checks.grpo_config_fields hands them to trl).
GRPO_CONFIG_FIELDS = SHARED_KEYS_OF_TRL_FIELDS

# Keys of earlier versions: what replaced each (a config that still sets one is refused, saying so).
RENAMED = {
    "rollouts.max_rows": "rollout.store.max_rows",
    "rollouts.max_text_bytes": "rollout.store.max_text_bytes",
    **{f"train.{field}": key for field, key in GRPO_CONFIG_FIELDS.items()},
    "system_prompt": "rollout.system_prompt",
    "rollout.sampler_threads": "rollout.collector_threads",
}


@dataclass
class RolloutStore:
    """Where every completion trl trains on is kept (``recipes.trl_grpo.rollout_store``)."""

    max_rows: Positive
    max_text_bytes: Positive


@dataclass
class Replay:
    """Rollouts that train again (``interop.GroupReplay``): groups whose rewards all tie train on stored ones."""

    enabled: bool
    capacity: Positive
    alpha: Annotated[float, Range(ge=0)]
    # A rollouts/ folder another run stored (<run>/rollouts): its groups fill the replay before the first step.
    load_from: str | None

    def __post_init__(self) -> None:
        if self.load_from is not None and not self.enabled:
            raise ValueError("load_from is set but enabled=false: set enabled=true to train on the loaded groups.")


@dataclass
class Eval:
    """Held-out evaluation (``recipes.trl_grpo.evaluation``): the data's eval prompts, scored by one reward function."""

    every_n_steps: Positive | None  # null: no evaluation
    num_prompts: Positive | None  # null: the whole eval split
    accuracy_source: str | None  # a reward.functions name whose values are 0 or 1


@dataclass
class Generation:
    """``rollout.generation``: the sampler's settings (``interop.SamplingSettings``, which checks their values), under
    the GRPO recipe's keys; trl gets them as ``GRPOConfig`` fields (:data:`GRPO_CONFIG_FIELDS`)."""

    max_new_tokens: Positive
    min_new_tokens: Annotated[int, Range(ge=0)]
    do_sample: bool
    temperature: Number
    top_k: Annotated[int, Range(ge=0)] | None
    top_p: Number
    min_p: Number | None
    repetition_penalty: Number


@dataclass
class Rollout:
    """How rollouts are made and kept: the group size and the sampler's settings, the prompt stream TorchRL samples
    for, when it samples (sync, or one generation batch ahead of trl's update), what trains again, and the store of
    what trl trained on."""

    group_size: Annotated[
        int,
        Range(ge=2),
        Hint(
            "{key}={value}: GRPO scores each completion against the other completions of its prompt (its advantage "
            "is the reward minus the group's mean), so a group needs at least 2; set {key} >= 2."
        ),
    ]
    system_prompt: str | None
    generation: Generation
    prompts_per_draw: Positive
    mode: Literal["sync", "async"]
    max_policy_lag: Annotated[int, Range(ge=0)]
    past_lag_bound: Literal["withhold", "resample"]  # interop.trl.rollout_func.PAST_LAG_BOUND
    # Where training batches are sampled (recipes.common.rollout_backend); null: the mode's default.
    backend: RolloutBackendName | None
    workers: Positive
    worker_resources: WorkerResourcesNode
    collector_threads: Positive
    # Apart from the learner: push the weights every this many updates; the samplers' dtype.
    weight_sync_every: Positive
    sampler_dtype: DType  # the same choices as dtype (float16: CUDA only, as dtype)
    # Assistant turns per dialog when tools: names tools (trl: max_tool_calling_iterations + 1).
    max_turns: Positive
    replay: Replay
    store: RolloutStore


@dataclass
class Reward:
    model_weight: Number  # as written: reward.model_weight=0 is refused quoting 0 (recipes.common.reward_functions)
    # name -> {function, weight}: the names are the user's, each entry a RewardFunctionNode.
    functions: RewardFunctions
    aggregation: Literal["sum_then_normalize", "normalize_then_sum"]  # trl's multi_objective_aggregation


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
    # Settings a resumed run may change beyond the free ones (recipes.trl_grpo.resume.RESUME_FREE_KEYS).
    resume_allow_changes: list[str]
    progress_bar: bool
    rollout: Rollout
    ray: RayNode
    reward: Reward
    # timeout_s and max_result_tokens, then <name>: {function} and <label>: {torchrl | mcp} entries, whose names are the
    # user's (recipes.common.tools checks each entry).
    tools: ToolsNode
    eval: Eval
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
    # The recipe decides these itself: a value here would be replaced, or would start another run than this one.
    reward_weights: Annotated[
        None,
        Hint(
            "{key}={value}: the recipe sets trl's reward weights from reward.model_weight (the reward model's) and "
            "reward.functions.<name>.weight (each function's), in that order; drop {key} and set those."
        ),
    ]
    resume_from_checkpoint: Annotated[
        None,
        Hint(
            "{key}={value}: a run resumes with resume=true, which continues this run folder from the newest of its "
            "trl checkpoints (train.output_dir/checkpoint-<step>) with its own settings; drop {key}. To start a "
            "new run from a checkpoint's weights, point model.name_or_path at that checkpoint folder."
        ),
    ]
    max_tool_calling_iterations: Annotated[
        None,
        Hint(
            "{key}={value}: trl's tool loop does not run here (TorchRL samples the dialogs); the turns are "
            "rollout.max_turns, trl's max_tool_calling_iterations + 1: drop {key} and set rollout.max_turns."
        ),
    ]
    lr_scheduler_type: str
    warmup_steps: Annotated[float, Range(ge=0)]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.warmup_steps and self.lr_scheduler_type in _IGNORE_WARMUP:
            raise ValueError(
                f"warmup_steps={self.warmup_steps:g} with lr_scheduler_type={self.lr_scheduler_type}: that schedule "
                "ignores warm-up (transformers builds it without the warm-up steps), so the run would start at the "
                "full learning rate. Use lr_scheduler_type=constant_with_warmup (warm-up, then constant) or linear "
                "(warm-up, then decay), or warmup_steps=0."
            )


# transformers' schedules built without num_warmup_steps (transformers.optimization.get_scheduler).
_IGNORE_WARMUP = ("constant", "reduce_lr_on_plateau", "greedy")
