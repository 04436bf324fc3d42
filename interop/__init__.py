"""Adapters between TorchRL and Hugging Face ``trl``, in three wings and two adapters at the top.

The wings:

- :mod:`interop.sampling`: a causal LM as a TorchRL policy and the processes that sample with copies of it.
  ``sampler`` (:class:`CausalLMSampler`, :class:`SamplingSettings`, :func:`sample_responses`: the decoding loop with a
  KV cache that records each sampled token's log-prob), ``rollouts`` (``RolloutSampler``: the sync rollout core,
  prompt ids to one completion or tool dialog per prompt in trl's ``rollout_func`` columns, used in the trainer's
  process and in every sampler apart from it), ``background`` (:class:`BackgroundSampler`: a copy of the model
  sampling in a child process on weights the caller publishes) and ``workers`` (:class:`RolloutWorkers`: several such
  copies, in local processes or Ray actors, a worker that dies replaced and its groups sampled again).
- :mod:`interop.tools`: tool calls and the dialogs that make them. ``runner`` (``ToolSet``, ``ToolRunner``: calls run
  in a worker process with a timeout), ``dialogs`` (``DialogSampler``: whole dialogs, the tool messages masked out),
  ``dialog_policy`` (``DialogPolicy``: those dialogs as a TorchRL policy), ``torchrl_tools`` (TorchRL's tool
  transforms taken apart into tools) and ``mcp_tools`` (MCP stdio servers' tools).
- :mod:`interop.trl`: ``trl.GRPOTrainer`` sampling through TorchRL. ``rollout_func`` (:class:`TorchRLRolloutFunc`: a
  TorchRL LLM policy, by default a :class:`CausalLMSampler` at the trainer's ``GRPOConfig`` settings, as trl's
  ``rollout_func``, sync, async or apart from the learner, optionally writing every rollout to a TorchRL
  ``ReplayBuffer``), ``trainer`` (:class:`TorchRLGRPOTrainer`: each generation batch written to a TorchRL buffer once
  trl has scored it; with ``TorchRLRolloutFunc(mode="async")`` the next batch sampled while trl updates; trl's
  ``vllm_importance_sampling_*`` correction applied to the TorchRL sampler's log-probs), ``group_replay``
  (:class:`GroupReplay`: scored GRPO groups replayed in proportion to their reward spread) and
  ``importance_sampling`` (that correction's modes and mismatch figures).

At the top:

- :class:`TorchRLBufferDataset` (``interop.dataset``): a TorchRL ``ReplayBuffer`` as a
  ``torch.utils.data.IterableDataset`` (and, through ``as_hf_dataset()``, a ``datasets.IterableDataset``) that trl
  trainers consume; :func:`tensordict_collate` turns its samples back into a batched ``TensorDict``.
- :class:`HFRewardModelWrapper` (``interop.reward``): an HF sequence-classification reward model as a TensorDict
  module; :class:`RewardModelTransform`: a TorchRL env ``Transform`` that scores each step with a reward module, or
  with several named and weighted ones (their NaN-skipping weighted sum, as trl sums ``reward_funcs``), in the
  reward-spec shape ``MCAdvantage`` and ``GRPOLoss`` expect. ``interop.prefix_scoring`` holds how the wrapper runs a
  prefix its rows share (a GRPO group's prompt) once (``share_prefixes=True``).

Every name above imports from ``interop`` itself. The module paths of the flat layout before the wings
(``interop.rollout_func``, ``interop.dialogs``, ``interop.trl_grpo``...) still import, as the module that holds their
code now, with a ``DeprecationWarning`` naming it (``interop/_exports.py`` lists them); ``interop.sampling`` and
``interop.tools`` became the packages of their wings and export every name the modules had.

Dependencies: ``torch``, ``tensordict`` and ``torchrl``; ``datasets``, ``transformers`` and ``trl`` are imported
lazily, only by the features that need them. This package knows nothing of Hydra or of the recipes.
"""

import sys as _sys

from interop._exports import MOVED_MODULES as _MOVED_MODULES
from interop._exports import MovedModuleFinder as _MovedModuleFinder
from interop._exports import lazy_exports as _lazy_exports

# Each public name is imported from its module when first used (PEP 562): `import interop.tools` or
# `import interop.tools.mcp_tools` in a tool worker process then costs no torch, torchrl or transformers import
# (seconds), which a worker restarted after a timeout would pay again; trl's trainer in particular prints a notice on
# import. The wings' packages (interop.sampling, interop.tools, interop.trl) export theirs the same way.
_MODULES = {
    "BackgroundSampler": "interop.sampling.background",
    "CausalLMSampler": "interop.sampling.sampler",
    "GroupReplay": "interop.trl.group_replay",
    "HFRewardModelWrapper": "interop.reward",
    "RewardModelTransform": "interop.reward",
    "RolloutWorkers": "interop.sampling.workers",
    "SamplingSettings": "interop.sampling.sampler",
    "TorchRLBufferDataset": "interop.dataset",
    "TorchRLGRPOTrainer": "interop.trl.trainer",
    "TorchRLRolloutFunc": "interop.trl.rollout_func",
    "sample_responses": "interop.sampling.sampler",
    "tensordict_collate": "interop.dataset",
}
__getattr__, __dir__ = _lazy_exports(__name__, _MODULES)

# The module paths of the flat layout (interop.rollout_func, interop.dialogs...) still import, as the module that
# holds their code now, with a DeprecationWarning naming it (interop/_exports.py).
if not any(isinstance(finder, _MovedModuleFinder) for finder in _sys.meta_path):
    _sys.meta_path.insert(0, _MovedModuleFinder(_MOVED_MODULES))

__all__ = [
    "BackgroundSampler",
    "CausalLMSampler",
    "GroupReplay",
    "HFRewardModelWrapper",
    "RewardModelTransform",
    "RolloutWorkers",
    "SamplingSettings",
    "TorchRLBufferDataset",
    "TorchRLGRPOTrainer",
    "TorchRLRolloutFunc",
    "sample_responses",
    "tensordict_collate",
]
