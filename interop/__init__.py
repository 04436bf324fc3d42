"""Adapters between TorchRL and Hugging Face ``trl``.

Public classes and functions:

- :class:`TorchRLBufferDataset`: a TorchRL ``ReplayBuffer`` as a ``torch.utils.data.IterableDataset`` (and, through
  ``as_hf_dataset()``, a ``datasets.IterableDataset``) that trl trainers consume.
- :func:`tensordict_collate`: turns a list of samples yielded by the dataset back into a batched ``TensorDict``.
- :class:`HFRewardModelWrapper`: an HF sequence-classification reward model as a TensorDict module.
- :class:`CausalLMSampler`: an HF causal LM as a TorchRL policy that samples a left-padded prompt batch with a KV
  cache and records each sampled token's log-prob; :class:`SamplingSettings` its settings (``max_new_tokens``,
  ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``...); :func:`sample_responses` the loop.
- :class:`TorchRLRolloutFunc`: a TorchRL LLM policy (by default a :class:`CausalLMSampler` with the trainer's
  ``GRPOConfig`` sampling settings) as ``trl.GRPOTrainer``'s ``rollout_func`` (trl samples through TorchRL),
  optionally writing every rollout into a TorchRL ``ReplayBuffer``.
- :class:`TorchRLGRPOTrainer`: ``trl.GRPOTrainer`` sampling through a :class:`TorchRLRolloutFunc`, each generation
  batch written to a TorchRL buffer once trl has scored it (text, rewards per function, reward, advantage); with
  ``TorchRLRolloutFunc(mode="async")`` the next batch is sampled (:class:`BackgroundSampler`, a child process) while
  trl updates, and with ``replay=GroupReplay(...)`` groups whose rewards tie train on stored informative groups; the
  ``GRPOConfig``'s ``vllm_importance_sampling_*`` correction (trl applies it to vLLM's completions only) applies to the
  TorchRL sampler's log-probs, with its mismatch metrics.
- :class:`GroupReplay`: scored GRPO groups in a TorchRL replay buffer, drawn in proportion to their reward spread.
- :class:`BackgroundSampler`: a copy of a causal LM sampling in a child process on weights the caller publishes.
- :class:`RolloutWorkers`: several such copies, in local processes or Ray actors (``interop.sampling.workers``), each
  prompt group sampled by one of them, a worker that dies replaced and its groups sampled again.
- :class:`RewardModelTransform`: a TorchRL env ``Transform`` that scores each step with a reward module, or with
  several named and weighted ones (their NaN-skipping weighted sum, as trl sums ``reward_funcs``), and writes the
  reward with the env's reward-spec shape (what ``MCAdvantage`` and ``GRPOLoss`` expect).

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
