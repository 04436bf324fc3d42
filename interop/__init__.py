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
- :class:`RolloutWorkers`: several such copies, in local processes or Ray actors (``interop.rollout_workers``), each
  prompt group sampled by one of them, a worker that dies replaced and its groups sampled again.
- :class:`RewardModelTransform`: a TorchRL env ``Transform`` that scores each step with a reward module, or with
  several named and weighted ones (their NaN-skipping weighted sum, as trl sums ``reward_funcs``), and writes the
  reward with the env's reward-spec shape (what ``MCAdvantage`` and ``GRPOLoss`` expect).

Dependencies: ``torch``, ``tensordict`` and ``torchrl``; ``datasets``, ``transformers`` and ``trl`` are imported
lazily, only by the features that need them. This package knows nothing of Hydra or of the recipes.
"""

import importlib

# Each public name is imported from its module when first used (PEP 562): `import interop.tools` or
# `import interop.mcp_tools` in a tool worker process then costs no torch, torchrl or transformers import (seconds),
# which a worker restarted after a timeout would pay again; trl's trainer in particular prints a notice on import.
_MODULES = {
    "BackgroundSampler": "interop.background_sampler",
    "CausalLMSampler": "interop.sampling",
    "GroupReplay": "interop.group_replay",
    "HFRewardModelWrapper": "interop.reward",
    "RewardModelTransform": "interop.reward",
    "RolloutWorkers": "interop.rollout_workers",
    "SamplingSettings": "interop.sampling",
    "TorchRLBufferDataset": "interop.dataset",
    "TorchRLGRPOTrainer": "interop.trl_grpo",
    "TorchRLRolloutFunc": "interop.rollout_func",
    "sample_responses": "interop.sampling",
    "tensordict_collate": "interop.dataset",
}


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'interop' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULES])


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
