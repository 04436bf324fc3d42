"""Rollouts that train again: scored GRPO groups kept in a TorchRL replay buffer and sampled, in proportion to how
much their rewards differ, to stand in for groups that teach nothing.

Public names:

- :class:`GroupReplay`: a TorchRL ``ReplayBuffer`` of whole groups (one entry per prompt's group of completions:
  token ids and masks, trl's advantages, the sampling log-probs, the reference's, the step they were sampled at),
  sampled with a :class:`ProportionalSampler` whose priority is each group's reward spread. A group whose rewards all
  tie has zero advantages (trl normalises within the group): trained on, it moves nothing. ``interop.
  TorchRLGRPOTrainer(replay=GroupReplay(...))`` stores every informative group of a batch and puts stored groups in
  the tied ones' places, with their stored sampling log-probs as trl's old log-probs so that the importance ratio
  corrects for their age (trl's experimental replay-buffer GRPO trainer did the same before trl 1.16 dropped it).
- :class:`ProportionalSampler`: a TorchRL sampler drawing each stored entry with probability ``priority ** alpha /
  sum(priority ** alpha)``.

Why not TorchRL's ``PrioritizedSampler``: its sum trees are a compiled extension, which TorchRL 0.14.1's wheel cannot
load beside torch 2.13 (an undefined symbol); a replay of at most a few thousand groups draws in microseconds without
them.

Dependencies: torch, tensordict, torchrl.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.data.replay_buffers.samplers import Sampler

__all__ = ["GroupReplay", "ProportionalSampler"]

# The fields of a stored group, each [G, ...]: what trl's loss reads of a row.
GROUP_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_logps")


class ProportionalSampler(Sampler):
    """Draws stored entries with probability proportional to ``priority ** alpha`` (with replacement).

    Keyword Args:
        capacity: the most entries the storage holds.
        alpha: how strongly priorities skew the draw (0: uniform).
        generator: the ``torch.Generator`` of the draws (``None``: torch's default).

    Examples:
        >>> import torch
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> buffer = ReplayBuffer(storage=LazyTensorStorage(4), sampler=ProportionalSampler(capacity=4))
        >>> index = buffer.extend(torch.arange(4.0))
        >>> buffer.update_priority(index, torch.tensor([0.0, 0.0, 1.0, 0.0]))
        >>> buffer.sample(3).tolist()
        [2.0, 2.0, 2.0]
    """

    def __init__(self, *, capacity: int, alpha: float = 1.0, generator: torch.Generator | None = None) -> None:
        if capacity < 1 or alpha < 0:
            raise ValueError(f"ProportionalSampler: capacity must be >= 1 and alpha >= 0, got {capacity}, {alpha}.")
        self.capacity, self.alpha, self.generator = capacity, alpha, generator
        self.priorities = torch.zeros(capacity, dtype=torch.float64)

    def extend(self, index: torch.Tensor) -> None:
        """New entries at ``index``: priority 1 until :meth:`update_priority` sets theirs."""
        self.priorities[torch.as_tensor(index, dtype=torch.long).reshape(-1)] = 1.0  # until update_priority

    def add(self, index: int) -> None:
        """One new entry at ``index`` (see :meth:`extend`)."""
        self.extend(torch.tensor([index]))

    def update_priority(self, index, priority, *, storage=None) -> None:
        """Sets the priorities of the entries at ``index`` (finite, >= 0; one value for all, or one each)."""
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        priority = torch.as_tensor(priority, dtype=torch.float64).reshape(-1).expand(index.shape[0])
        if not bool(torch.isfinite(priority).all()) or bool((priority < 0).any()):
            raise ValueError(f"ProportionalSampler: priorities must be finite and >= 0, got {priority.tolist()}.")
        self.priorities[index] = priority

    def sample(self, storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        """``batch_size`` indices of ``storage``'s entries, drawn with replacement by ``priority ** alpha``."""
        stored = len(storage)
        if stored == 0:
            raise RuntimeError("ProportionalSampler: the storage is empty; nothing to sample.")
        index = torch.multinomial(self._weights(stored), batch_size, replacement=True, generator=self.generator)
        return index, {"index": index}

    def _weights(self, stored: int) -> torch.Tensor:
        """``priority ** alpha`` scaled by the largest, computed in log space: raised to a large ``alpha``, spreads
        below 1 underflow to 0 (the draw would turn uniform) and spreads above 1 overflow (``torch.multinomial``
        refuses infinities); relative to the largest, the largest weighs 1 and the others what they can. Uniform when
        ``alpha`` is 0 or every priority is 0."""
        uniform = torch.ones(stored, dtype=torch.float64)
        if self.alpha == 0:
            return uniform
        log_weights = self.alpha * self.priorities[:stored].log()  # a priority of 0: -inf, a weight of 0
        largest = log_weights.max()
        return (log_weights - largest).exp() if bool(torch.isfinite(largest)) else uniform

    def _empty(self) -> None:
        self.priorities.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The priorities (a copy), what a checkpoint keeps."""
        return {"priorities": self.priorities.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the priorities :meth:`state_dict` returned."""
        self.priorities = state_dict["priorities"].clone()

    def dumps(self, path) -> None:
        """Writes the priorities into the buffer folder ``path`` (TorchRL's ``ReplayBuffer.dumps`` calls it)."""
        torch.save(self.state_dict(), f"{path}/proportional_sampler.pt")

    def loads(self, path) -> None:
        """Reads the priorities :meth:`dumps` wrote (tensors only: ``weights_only=True``)."""
        self.load_state_dict(torch.load(f"{path}/proportional_sampler.pt", weights_only=True))


class GroupReplay:
    """Scored GRPO groups, kept and sampled by their reward spread.

    Keyword Args:
        capacity: the most groups kept (the oldest go first).
        alpha: the priority exponent (:class:`ProportionalSampler`).
        seed: the draws' seed.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> replay = GroupReplay(capacity=8)
        >>> def group(value, spread):
        ...     return TensorDict({"prompt_ids": torch.full((2, 3), value), "prompt_mask": torch.ones(2, 3),
        ...                        "completion_ids": torch.full((2, 2), value), "completion_mask": torch.ones(2, 2),
        ...                        "advantages": torch.tensor([-1.0, 1.0]), "old_logps": -torch.ones(2, 2)},
        ...                       batch_size=[2])
        >>> replay.add(group(5, 1.0), reward_std=1.0, step=3)
        >>> replay.add(group(6, 0.0), reward_std=0.0, step=4)
        >>> [int(g["completion_ids"][0, 0]) for g in replay.sample(2)]  # the group that ties is never drawn
        [5, 5]
    """

    def __init__(self, *, capacity: int = 1024, alpha: float = 1.0, seed: int = 0) -> None:
        self.capacity = capacity
        self.sampler = ProportionalSampler(
            capacity=capacity, alpha=alpha, generator=torch.Generator().manual_seed(seed)
        )
        self.buffer = ReplayBuffer(storage=LazyStackStorage(capacity), sampler=self.sampler)

    def __len__(self) -> int:
        return len(self.buffer)

    def add(self, group: TensorDictBase, *, reward_std: float, step: int) -> None:
        """Keeps one group (``[G]`` rows of :data:`GROUP_FIELDS`, ``ref_logps`` optional), drawn later with weight
        ``reward_std ** alpha``."""
        missing = [field for field in GROUP_FIELDS if field not in group.keys()]
        if missing:
            raise KeyError(f"GroupReplay.add: the group lacks {missing}; a stored group holds {list(GROUP_FIELDS)}.")
        entry = group.clone()
        entry.set("step", torch.full(group.batch_size, int(step), dtype=torch.long))
        index = self.buffer.extend(LazyStackedTensorDict(entry))
        self.buffer.update_priority(index, torch.tensor([float(reward_std) if math.isfinite(reward_std) else 0.0]))

    def sample(self, count: int) -> list[TensorDictBase]:
        """``count`` stored groups (with replacement), each ``[G]`` rows as stored."""
        if count == 0 or len(self) == 0:
            return []
        index, _ = self.sampler.sample(self.buffer.storage, count)
        return [self.buffer.storage[int(i)] for i in index.tolist()]

    def drawable(self) -> int:
        """How many stored groups can be drawn (their reward spread is above zero)."""
        return int((self.sampler.priorities[: len(self)] > 0).sum())

    def load_rows(self, rows: TensorDictBase, *, group_size: int, pad_token_id: int) -> int:
        """Fills the replay with the groups of stored rollouts (``recipes``' rollout store layout: ``prompt_ids``
        left-padded with ``prompt_length``, ``completion_ids`` right-padded with ``completion_length``, ``logprobs``,
        ``advantage``, ``reward``, ``step``): consecutive runs of ``group_size`` rows of one prompt and step. Returns
        the groups kept. The stored steps are another run's: each group keeps its age relative to the newest stored
        one, which counts as sampled at step 0 (before this run's first update), so that no age is negative."""
        newest = int(rows["step"].max()) if rows.shape[0] else 0
        kept = 0
        for start in range(0, rows.shape[0] - group_size + 1, group_size):
            block = rows[start : start + group_size]
            same_prompt = bool((block["prompt_ids"] == block["prompt_ids"][:1]).all())
            same_step = bool((block["step"] == block["step"][0]).all())
            if not (same_prompt and same_step):
                continue
            step = int(block["step"][0]) - newest
            self.add(_group_of_rows(block, pad_token_id), reward_std=_std(block["reward"]), step=step)
            kept += 1
        return kept


def _std(values: torch.Tensor) -> float:
    finite = values[torch.isfinite(values)].double()
    return float(finite.std(unbiased=True)) if finite.numel() > 1 else 0.0


def _group_of_rows(block: TensorDictBase, pad_token_id: int) -> TensorDict:
    prompt_width = block["prompt_ids"].shape[-1]
    prompt_mask = torch.arange(prompt_width) >= prompt_width - block["prompt_length"][:, None]
    completion_mask = torch.arange(block["completion_ids"].shape[-1]) < block["completion_length"][:, None]
    return TensorDict(
        {
            "prompt_ids": block["prompt_ids"],
            "prompt_mask": prompt_mask.long(),
            "completion_ids": torch.where(completion_mask, block["completion_ids"], pad_token_id),
            "completion_mask": completion_mask.long(),
            "advantages": block["advantage"].float(),
            "old_logps": torch.where(completion_mask, block["logprobs"].float(), 0.0),
        },
        batch_size=[block.shape[0]],
    )


def pad_rows(tensors: Sequence[torch.Tensor], *, side: str, value) -> torch.Tensor:
    """Stacks ``[n_i, w_i]`` tensors into ``[sum n_i, max w]``, padded on ``side``."""
    width = max(t.shape[-1] for t in tensors)
    padded = [
        torch.nn.functional.pad(
            t, (width - t.shape[-1], 0) if side == "left" else (0, width - t.shape[-1]), value=value
        )
        for t in tensors
    ]
    return torch.cat(padded, dim=0)
