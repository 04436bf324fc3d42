"""TorchRL losses as the recipes use them.

- :class:`OnPolicyGRPOLoss`: TorchRL's ``GRPOLoss`` for batches trained on once, right after they were sampled.

Dependencies: torch, torchrl.
"""

from __future__ import annotations

from torchrl.objectives.llm import GRPOLoss

__all__ = ["OnPolicyGRPOLoss"]


class OnPolicyGRPOLoss(GRPOLoss):
    """``GRPOLoss`` that reads a batch without old log-probs as on-policy: the old log-probs are the current ones.

    When every step's responses go through a single update, the policy that sampled them is the policy being updated:
    the old log-probs of the importance ratio equal the current ones, the ratio is exactly 1 and nothing is clipped.
    Recomputing them costs one forward pass over the batch for nothing; this loss takes the current log-probs,
    detached, in their place (as ``trl.GRPOTrainer`` does with one update per generation batch), so the objective,
    its gradient and every diagnostic are those ``GRPOLoss`` gives with recomputed old log-probs.

    A batch that carries old log-probs (at ``tensor_keys.sample_log_prob``) is trained exactly as by ``GRPOLoss``.
    The arguments are ``GRPOLoss``'s.
    """

    def _get_cur_log_prob(self, tensordict):
        # GRPOLoss.forward works on a shallow copy of the batch, and its _log_weight reads the old log-probs right
        # after this call: writing them here leaves the caller's batch untouched.
        log_prob, dist, is_composite = super()._get_cur_log_prob(tensordict)
        if tensordict.get(self.tensor_keys.sample_log_prob, None) is None:
            tensordict.set(self.tensor_keys.sample_log_prob, log_prob.detach())
        return log_prob, dist, is_composite
