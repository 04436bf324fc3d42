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
  trl updates, and with ``replay=GroupReplay(...)`` groups whose rewards tie train on stored informative groups.
- :class:`GroupReplay`: scored GRPO groups in a TorchRL replay buffer, drawn in proportion to their reward spread.
- :class:`BackgroundSampler`: a copy of a causal LM sampling in a child process on weights the caller publishes.
- :class:`RewardModelTransform`: a TorchRL env ``Transform`` that scores each step with a reward module, or with
  several named and weighted ones (their NaN-skipping weighted sum, as trl sums ``reward_funcs``), and writes the
  reward with the env's reward-spec shape (what ``MCAdvantage`` and ``GRPOLoss`` expect).

Dependencies: ``torch``, ``tensordict`` and ``torchrl``; ``datasets``, ``transformers`` and ``trl`` are imported
lazily, only by the features that need them. This package knows nothing of Hydra or of the recipes.
"""

from interop.background_sampler import BackgroundSampler
from interop.dataset import TorchRLBufferDataset, tensordict_collate
from interop.group_replay import GroupReplay
from interop.reward import HFRewardModelWrapper, RewardModelTransform
from interop.rollout_func import TorchRLRolloutFunc
from interop.sampling import CausalLMSampler, SamplingSettings, sample_responses


def __getattr__(name: str):
    # trl is heavy to import and prints a notice: only where its trainer is used.
    if name == "TorchRLGRPOTrainer":
        from interop.trl_grpo import TorchRLGRPOTrainer

        return TorchRLGRPOTrainer
    raise AttributeError(f"module 'interop' has no attribute {name!r}")


__all__ = [
    "BackgroundSampler",
    "CausalLMSampler",
    "GroupReplay",
    "HFRewardModelWrapper",
    "RewardModelTransform",
    "SamplingSettings",
    "TorchRLBufferDataset",
    "TorchRLGRPOTrainer",
    "TorchRLRolloutFunc",
    "sample_responses",
    "tensordict_collate",
]
