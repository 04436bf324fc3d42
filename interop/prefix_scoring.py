"""Scoring sequences that repeat a prefix with each prefix run through the model once.

A GRPO batch holds ``group_size`` responses to every prompt, so a reward model that scores prompt + response reads
each prompt ``group_size`` times. Here the rows are split into groups of consecutive rows that share a token prefix;
each group's prefix runs through the model once, and its keys and values, copied into a cache row for every row of
the group, are read (not recomputed) by one pass over the rows' remaining tokens. With causal attention the result
equals the padded pass over whole rows up to float rounding.

- :func:`can_share_prefixes`: whether a model can be scored so: a ``transformers`` decoder whose layers all attend to
  the whole sequence (a sliding window or a recurrent layer keeps other state), whose ``forward`` takes a cache and
  position ids, and whose config names a pad id (sequence classifiers score the last token that is not one).
- :func:`plan_shared_prefixes`: the groups and their prefix lengths, or ``None`` where sharing would not save
  at least ``min_saving`` of the positions a padded pass computes.
- :func:`shared_prefix_inputs`: the two passes' inputs, and :func:`run_shared_prefixes`: the model's output for the
  rows' remaining tokens, as a padded pass would pool it.

Dependencies: torch; ``transformers``' ``DynamicCache`` (imported when a batch is scored shared).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PrefixPlan",
    "SharedPrefixInputs",
    "can_share_prefixes",
    "plan_shared_prefixes",
    "run_shared_prefixes",
    "shared_prefix_inputs",
]

# Sharing runs two passes instead of one: below this share of the padded pass's positions saved it is not worth it.
MIN_SAVING = 0.15


def can_share_prefixes(model: Any) -> bool:
    """Whether :func:`run_shared_prefixes` scores ``model`` exactly as a padded pass over whole rows would."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config") or getattr(config, "is_encoder_decoder", False):
        return False
    text_config = config.get_text_config()
    layer_types = getattr(text_config, "layer_types", None) or ["full_attention"]
    if set(layer_types) != {"full_attention"} or getattr(text_config, "use_sliding_window", False):
        return False
    if getattr(text_config, "pad_token_id", None) is None:
        return False
    return _model_cache_argument(model) is not None


def _model_cache_argument(model: Any) -> str | None:
    """:func:`_cache_argument` of ``model.forward``: cached per class function (the bound method's ``__func__``); a
    forward set on the instance (an accelerate hook, a closure over the model) is read each time, so that the cache
    keeps no model alive."""
    forward = model.forward
    function = getattr(forward, "__func__", None)
    return _cache_argument(function) if function is not None else _cache_argument.__wrapped__(forward)


@functools.cache
def _cache_argument(forward: Callable) -> str | None:
    """The argument a model class's ``forward`` takes its key/value cache by (``cache`` or ``past_key_values``), or
    ``None`` where it takes no cache or no ``position_ids``: read once per class, not on every scored batch."""
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None
    if "position_ids" not in parameters:
        return None
    return "cache" if "cache" in parameters else "past_key_values" if "past_key_values" in parameters else None


@dataclass(frozen=True)
class PrefixPlan:
    """Groups of consecutive rows, ``(start, stop)``, and the number of leading tokens each group's rows share."""

    groups: list[tuple[int, int]]
    prefix_lengths: list[int]

    def group_of_rows(self) -> torch.Tensor:
        """Each row's group index, ``[rows]``."""
        return torch.cat(
            [torch.full((stop - start,), index, dtype=torch.long) for index, (start, stop) in enumerate(self.groups)]
        )


def _common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length


def _last_real_token(seq: Sequence[int], pad_token_id: int) -> int:
    """The index of ``seq``'s last token that is not the pad id (-1 if none): where a classifier pools."""
    for index in range(len(seq) - 1, -1, -1):
        if seq[index] != pad_token_id:
            return index
    return -1


def plan_shared_prefixes(
    seqs: Sequence[Sequence[int]], *, pad_token_id: int, min_saving: float = MIN_SAVING
) -> PrefixPlan | None:
    """The groups of ``seqs`` (token id lists) that share a prefix, or ``None`` when sharing does not pay.

    Two consecutive rows share a prefix as long as their prompt within a GRPO group, and at most a chat template's
    header between two groups: the groups split where the common prefix of two consecutive rows falls below the
    widest gap among all such lengths (none when they are all alike). A group's prefix is what all its rows share,
    cut so that each row keeps its last non-pad token after it (a classifier pools there); a group of one row shares
    all but that token.
    """
    if len(seqs) < 2:
        return None
    common = [_common_prefix(seqs[i - 1], seqs[i]) for i in range(1, len(seqs))]
    lengths = sorted(set(common))
    gaps = [(upper - lower, upper) for lower, upper in zip(lengths, lengths[1:])]
    threshold = max(gaps)[1] if gaps else lengths[0]
    if threshold < 1:
        return None
    groups, lengths, start = [], [], 0
    for stop in range(1, len(seqs) + 1):
        if stop < len(seqs) and common[stop - 1] >= threshold:
            continue
        rows = range(start, stop)
        shared = min(common[start : stop - 1]) if stop - start > 1 else len(seqs[start]) - 1
        shared = min(shared, *(_last_real_token(seqs[row], pad_token_id) for row in rows))
        if shared < 1:
            return None
        groups.append((start, stop))
        lengths.append(shared)
        start = stop
    padded = len(seqs) * max(len(seq) for seq in seqs)
    rest = [len(seqs[row]) - n for (first, stop), n in zip(groups, lengths, strict=True) for row in range(first, stop)]
    suffix = max(rest)
    shared_cost = len(groups) * max(lengths) + len(seqs) * suffix
    return PrefixPlan(groups, lengths) if shared_cost <= (1 - min_saving) * padded else None


@dataclass(frozen=True)
class SharedPrefixInputs:
    """The two passes' inputs: the prefixes ``[groups, P]`` and the rows' remaining tokens ``[rows, S]``, both padded
    on the right; ``attention_mask`` ``[rows, P + S]`` covers a row's prefix (its group's) and its own tokens."""

    prefix_ids: torch.Tensor
    prefix_mask: torch.Tensor
    prefix_positions: torch.Tensor
    suffix_ids: torch.Tensor
    attention_mask: torch.Tensor
    suffix_positions: torch.Tensor
    group_of_rows: torch.Tensor


def _right_padded(rows: list[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(row) for row in rows)
    ids = torch.tensor([list(row) + [pad_token_id] * (longest - len(row)) for row in rows], dtype=torch.long)
    mask = torch.arange(longest) < torch.tensor([len(row) for row in rows]).unsqueeze(-1)
    return ids, mask.long()


def shared_prefix_inputs(seqs: Sequence[Sequence[int]], plan: PrefixPlan, *, pad_token_id: int) -> SharedPrefixInputs:
    """The inputs of :func:`run_shared_prefixes` for ``seqs`` grouped by ``plan``.

    Prefixes are padded on the right, so that no query attends to nothing (a fully masked row would give NaN keys
    and values to the cache); positions follow the attention mask (``cumsum - 1``): a row's tokens sit at the same
    positions as in its own unpadded pass, whatever padding sits between its prefix and the rest.
    """
    prefixes = [seqs[start][:length] for (start, _), length in zip(plan.groups, plan.prefix_lengths, strict=True)]
    prefix_ids, prefix_mask = _right_padded(prefixes, pad_token_id)
    group_of_rows = plan.group_of_rows()
    suffixes = [
        seqs[row][length:]
        for (start, stop), length in zip(plan.groups, plan.prefix_lengths, strict=True)
        for row in range(start, stop)
    ]
    suffix_ids, suffix_mask = _right_padded(suffixes, pad_token_id)
    attention_mask = torch.cat([prefix_mask[group_of_rows], suffix_mask], dim=-1)
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    return SharedPrefixInputs(
        prefix_ids=prefix_ids,
        prefix_mask=prefix_mask,
        prefix_positions=(prefix_mask.cumsum(-1) - 1).clamp_min(0),
        suffix_ids=suffix_ids,
        attention_mask=attention_mask,
        suffix_positions=positions[:, prefix_ids.shape[-1] :],
        group_of_rows=group_of_rows,
    )


def run_shared_prefixes(model: Any, inputs: SharedPrefixInputs, device: torch.device | None = None) -> Any:
    """``model``'s output for the rows' remaining tokens (``[rows, ...]``), each group's prefix run once.

    A sequence classifier pools the last token that is not its pad id: :func:`plan_shared_prefixes` keeps that
    token after the prefix, so the pooled value is the padded pass's.
    """
    from transformers import DynamicCache

    def on_device(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=True) if device is not None else tensor

    cache_key = _model_cache_argument(model) or "past_key_values"
    cache = DynamicCache(config=model.config)
    model(
        input_ids=on_device(inputs.prefix_ids),
        attention_mask=on_device(inputs.prefix_mask),
        position_ids=on_device(inputs.prefix_positions),
        use_cache=True,
        **{cache_key: cache},
    )
    group_of_rows = typing.cast(torch.LongTensor, on_device(inputs.group_of_rows))
    cache.reorder_cache(group_of_rows)  # every row reads its group's keys and values
    return model(
        input_ids=on_device(inputs.suffix_ids),
        attention_mask=on_device(inputs.attention_mask),
        position_ids=on_device(inputs.suffix_positions),
        use_cache=True,
        **{cache_key: cache},
    )
