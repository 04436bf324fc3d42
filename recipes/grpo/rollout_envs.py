"""The GRPO recipe's rollouts (``rollout.env``): one table of what each honours and refuses, which the schema's
choices, the checks, the loss and the learner read instead of comparing names.

- ``prompt``: the recipe's dense prompt env and its own sampler (``interop.CausalLMSampler``, or
  ``interop.tools.dialog_policy.DialogPolicy`` with tools), built by ``recipes.grpo.collector``.
- ``chat``: TorchRL's ``ChatEnv`` with its ``TransformersWrapper``, for TorchRL's multi-turn and tool transforms
  (``recipes.common.chat``).

Adding one is a row here, its collector in ``recipes.grpo.collector.make_collector`` and the layout of its steps in
``recipes.grpo.rewards.rollout_step_keys``, its name in ``docs/configuration.md`` and the ``rollout.env`` comment of
``conf/grpo_torchrl_rm.yaml`` (``tests/test_registries.py`` holds them together).

Dependencies: none beyond the standard library (the schema imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ROLLOUT_ENVS", "RolloutEnvName", "RolloutEnvSpec"]


@dataclass(frozen=True)
class RolloutEnvSpec:
    """What one ``rollout.env`` honours (``True``) and refuses (``False``), each refusal a ConfigError of the checks.

    Attributes:
        summary: what samples the batches, for people.
        takes_sampler_settings: ``rollout.generation`` holds ``interop.sampling.SamplingSettings`` fields (else any
            ``transformers.GenerationConfig`` field).
        records_sampler_log_probs: its batches carry the log-probs the sampler drew with (``loss.sampler_correction``
            and the sampler-mismatch metrics need them; else the learner scores the old log-probs itself).
        samples_tool_dialogs: it samples ``tools:`` dialogs in GRPO groups.
        carries_data_rows: its steps carry each prompt's data row (``reward.functions`` read it).
        runs_apart: its collector runs in a process of its own (``rollout.mode=async``, ``rollout.backend`` other
            than ``learner``).
        keeps_processes_in_step: its sampler runs as many forward passes on every process (``distributed.strategy=
            fsdp``).
        evaluates: ``eval.every_n_steps`` samples with its sampler.
    """

    summary: str
    takes_sampler_settings: bool
    records_sampler_log_probs: bool
    samples_tool_dialogs: bool
    carries_data_rows: bool
    runs_apart: bool
    keeps_processes_in_step: bool
    evaluates: bool


ROLLOUT_ENVS: dict[str, RolloutEnvSpec] = {
    "prompt": RolloutEnvSpec(
        "the recipe's dense prompt env and its own sampler (one response, or tool dialogs)",
        takes_sampler_settings=True,
        records_sampler_log_probs=True,
        samples_tool_dialogs=True,
        carries_data_rows=True,
        runs_apart=True,
        keeps_processes_in_step=True,
        evaluates=True,
    ),
    "chat": RolloutEnvSpec(
        "TorchRL's ChatEnv and TransformersWrapper, for TorchRL's multi-turn and tool transforms",
        takes_sampler_settings=False,
        # TorchRL 0.14.1's wrapper zeroes each response's first log-prob.
        records_sampler_log_probs=False,
        # ChatEnv refuses [prompts, group] batches and pads rows that called fewer tools (docs/tools.md).
        samples_tool_dialogs=False,
        carries_data_rows=False,
        runs_apart=False,
        # generate() stops decoding per process when its rows are done.
        keeps_processes_in_step=False,
        evaluates=False,
    ),
}

# rollout.env's choices in the schema: the table's names.
RolloutEnvName = Literal[tuple(ROLLOUT_ENVS)]  # type: ignore[valid-type]
