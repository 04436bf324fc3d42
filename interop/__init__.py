"""Adapters between TorchRL and Hugging Face ``trl``.

Public classes and functions:

- :class:`TorchRLBufferDataset`: a TorchRL ``ReplayBuffer`` as a ``torch.utils.data.IterableDataset`` (and, through
  ``as_hf_dataset()``, a ``datasets.IterableDataset``) that trl trainers consume.
- :func:`tensordict_collate`: turns a list of samples yielded by the dataset back into a batched ``TensorDict``.
- :class:`HFRewardModelWrapper`: an HF sequence-classification reward model as a TensorDict module.
- :class:`TorchRLRolloutFunc`: a TorchRL LLM policy as ``trl.GRPOTrainer``'s ``rollout_func`` (trl samples through
  TorchRL), optionally writing every rollout into a TorchRL ``ReplayBuffer``.
- :class:`RewardModelTransform`: a TorchRL env ``Transform`` that scores each step with a reward module and writes
  the reward with the env's reward-spec shape (what ``MCAdvantage`` and ``GRPOLoss`` expect).

Dependencies: ``torch``, ``tensordict`` and ``torchrl``; ``datasets`` and ``transformers`` are imported lazily, only
by the features that need them. This package knows nothing of Hydra or of the recipes.
"""

from interop.dataset import TorchRLBufferDataset, tensordict_collate
from interop.reward import HFRewardModelWrapper, RewardModelTransform
from interop.rollout import TorchRLRolloutFunc

__all__ = [
    "HFRewardModelWrapper",
    "RewardModelTransform",
    "TorchRLBufferDataset",
    "TorchRLRolloutFunc",
    "tensordict_collate",
]
