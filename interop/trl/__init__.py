"""The trl wing: ``trl.GRPOTrainer`` sampling through TorchRL.

- :mod:`interop.trl.rollout_func`: :class:`TorchRLRolloutFunc`, a TorchRL LLM policy as ``trl.GRPOTrainer``'s
  ``rollout_func`` (sync in the trainer's process, or async / apart from it on :mod:`interop.sampling` workers).
- :mod:`interop.trl.trainer`: :class:`TorchRLGRPOTrainer`, ``trl.GRPOTrainer`` with such a rollout function, each
  scored generation batch written to a TorchRL buffer, and trl's sampler correction applied to TorchRL's log-probs.
- :mod:`interop.trl.group_replay`: :class:`GroupReplay`, scored GRPO groups replayed in proportion to their spread.
- :mod:`interop.trl.importance_sampling`: that correction's modes and its sampler/trainer mismatch figures.

The names are read from their module when first used (PEP 562): ``trl`` itself is imported by
:mod:`interop.trl.trainer` only (it prints a notice on import).

Dependencies: ``torch``, ``tensordict``, ``torchrl``; ``trl`` and ``transformers`` for the trainer. (Inside this
package ``import trl`` still means the ``trl`` distribution: imports are absolute.)
"""

from typing import TYPE_CHECKING

from interop._exports import lazy_exports as _lazy_exports

if TYPE_CHECKING:
    from interop.trl.group_replay import GroupReplay
    from interop.trl.rollout_func import TorchRLRolloutFunc
    from interop.trl.trainer import TorchRLGRPOTrainer

__all__ = ["GroupReplay", "TorchRLGRPOTrainer", "TorchRLRolloutFunc"]
_EXPORTS = {
    "GroupReplay": "interop.trl.group_replay",
    "TorchRLGRPOTrainer": "interop.trl.trainer",
    "TorchRLRolloutFunc": "interop.trl.rollout_func",
}
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
