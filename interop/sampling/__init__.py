"""The sampling wing: a causal LM as a TorchRL policy, and the processes that sample with copies of it.

- :mod:`interop.sampling.sampler`: :class:`CausalLMSampler` (an HF causal LM as a TorchRL policy: a left-padded
  prompt batch sampled with a KV cache, each sampled token's log-prob recorded), :class:`SamplingSettings` (its
  ``GenerationConfig`` fields), :func:`sample_responses` (the decoding loop), and the TensorDict keys it reads and
  writes (TorchRL's LLM layout: :data:`PROMPT_TOKENS`, :data:`LOG_PROBS`...).
- :mod:`interop.sampling.decode_step`: :class:`~interop.sampling.decode_step.DecodeStep`, the decoding loop's step
  for Llama, Qwen2 and Qwen3 models: the model's own modules and functions without the Python of its wrappers (the
  same logits, bit for bit).
- :mod:`interop.sampling.rollouts`: :class:`RolloutSampler`, the sync rollout core: prompt token ids in, one
  completion (or tool dialog) per prompt out, in the columns of trl's ``rollout_func``; what
  :class:`interop.TorchRLRolloutFunc` samples with in the trainer's process, and every sampler apart from it too.
- :mod:`interop.sampling.background`: :class:`BackgroundSampler`, a copy of the model sampling in a child process on
  weights the caller publishes (its child's entry: ``interop.sampling._child``).
- :mod:`interop.sampling.child_processes`: how those children start: forked from Python's fork server, which imports
  their modules once per process (or spawned).
- :mod:`interop.sampling.workers`: :class:`RolloutWorkers`, several such copies in local processes or Ray actors
  (the watcher of a Ray cluster it starts: ``interop.sampling._ray_janitor``).

Each name is imported from its module when first read (PEP 562), so that a child process importing its entry module
pays for no torch import before it has made sure it dies with its parent.

Dependencies: ``torch``, ``tensordict``, ``torchrl``; ``transformers`` for the KV cache; ``ray`` for Ray workers.
"""

from typing import TYPE_CHECKING

from interop._exports import lazy_exports as _lazy_exports

if TYPE_CHECKING:
    from interop.sampling.background import BackgroundSampler
    from interop.sampling.rollouts import RolloutSampler
    from interop.sampling.sampler import (
        ATTENTION_MASK,
        LOG_PROBS,
        POLICY_VERSION,
        PROMPT_MASK,
        PROMPT_TOKENS,
        RESPONSE_TOKENS,
        TOKENS,
        TRUNCATED,
        CausalLMSampler,
        KeptCache,
        SampledResponses,
        SamplingSettings,
        check_pad_token,
        end_of_response_ids,
        sample_responses,
    )
    from interop.sampling.workers import RolloutWorkers

__all__ = [
    "ATTENTION_MASK",
    "BackgroundSampler",
    "CausalLMSampler",
    "KeptCache",
    "LOG_PROBS",
    "POLICY_VERSION",
    "PROMPT_MASK",
    "PROMPT_TOKENS",
    "RESPONSE_TOKENS",
    "RolloutSampler",
    "RolloutWorkers",
    "SampledResponses",
    "SamplingSettings",
    "TOKENS",
    "TRUNCATED",
    "check_pad_token",
    "end_of_response_ids",
    "sample_responses",
]
# Every name `interop.sampling` held when it was one module (the sampler's), the rollout core and the samplers apart.
_EXPORTS = {
    **dict.fromkeys(__all__, "interop.sampling.sampler"),
    "BackgroundSampler": "interop.sampling.background",
    "RolloutSampler": "interop.sampling.rollouts",
    "RolloutWorkers": "interop.sampling.workers",
}
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
