"""TorchRL advantages and losses as the recipes use them.

- :class:`GroupAdvantage`: TorchRL's ``MCAdvantage`` (GRPO's group normalisation) run over the three entries it reads.
- :class:`OnPolicyGRPOLoss`: TorchRL's ``GRPOLoss`` for batches trained on once, right after they were sampled.

Dependencies: torch, tensordict, torchrl.
"""

from __future__ import annotations

import torch
from tensordict import NestedKey, TensorDictBase
from torchrl.objectives.llm import GRPOLoss, MCAdvantage

__all__ = ["GroupAdvantage", "OnPolicyGRPOLoss"]


class GroupAdvantage:
    """Writes GRPO advantages into a batch of whole groups: TorchRL's ``MCAdvantage`` over a slim copy of it.

    ``MCAdvantage`` queues, concatenates and re-splits every sample it is given, one at a time, with all its entries;
    given the prompt id, reward and done flag alone (and a sample index, to put each advantage back in its row), it
    computes the same advantages at a third of the cost of going through a replay buffer's transforms with the token
    tensors. The batch must hold whole groups (``group_size`` samples per prompt id), as a GRPO step does.

    Args:
        group_size: samples per prompt (``MCAdvantage``'s ``grpo_size``).

    Keyword Args:
        prompt_key: the group id of each sample.
        reward_key: the reward of each sample (``[N, 1, 1]`` for single-turn rollouts).
        done_key: the done flag of each sample.
        advantage_key: where the advantages go, shaped like the rewards.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> rewards = torch.tensor([1.0, 5.0, 3.0, 5.0]).view(4, 1, 1)
        >>> batch = TensorDict(
        ...     {"prompt_index": torch.tensor([0, 1, 0, 1]),
        ...      "next": {"reward": rewards, "done": torch.ones(4, 1, dtype=torch.bool)}},
        ...     batch_size=[4],
        ... )
        >>> GroupAdvantage(2)(batch)["advantage"].view(-1)
        tensor([-0.7071,  0.0000,  0.7071,  0.0000])
    """

    def __init__(
        self,
        group_size: int,
        *,
        prompt_key: NestedKey = "prompt_index",
        reward_key: NestedKey = ("next", "reward"),
        done_key: NestedKey = ("next", "done"),
        advantage_key: NestedKey = "advantage",
    ) -> None:
        self.keys = (prompt_key, reward_key, done_key)
        self.advantage_key = advantage_key
        self.transform = MCAdvantage(
            grpo_size=group_size,
            prompt_key=prompt_key,
            rewards_key=reward_key,
            done_key=done_key,
            advantage_key=advantage_key,
        )

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        if batch.ndim != 1:
            raise ValueError(f"GroupAdvantage: expected a flat batch, got batch size {tuple(batch.batch_size)}.")
        slim = batch.select(*self.keys).to_tensordict()
        slim.set("_row", torch.arange(batch.shape[0]))
        scored = self.transform.inv(slim)
        if scored is None or scored.shape[0] != batch.shape[0]:
            self.transform.queues.clear()  # never leave a partial group to mix with the next batch
            raise ValueError(
                f"GroupAdvantage: the batch of {batch.shape[0]} samples does not hold whole groups of "
                f"{self.transform.grpo_size} samples per {self.keys[0]!r}."
            )
        advantage = torch.empty_like(scored.get(self.advantage_key))
        advantage[scored.get("_row")] = scored.get(self.advantage_key)
        batch.set(self.advantage_key, advantage)
        return batch


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
