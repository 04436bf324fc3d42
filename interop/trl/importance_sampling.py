"""How far a sampler's log-probs are from the trainer's, in trl 1.16's terms (its ``vllm_importance_sampling_*``).

- :data:`IMPORTANCE_SAMPLING_MODES`: trl's ``vllm_importance_sampling_mode`` values.
- :func:`sampler_mismatch_counts`: the sums behind the mismatch figures of one batch (they add up over batches and
  processes); :func:`sampler_mismatch_metrics`: the figures, from those sums.

Kept apart from ``interop.trl.trainer`` (which imports trl) so that a trainer of its own, e.g. the GRPO recipe's, can
report the same figures without importing trl.

Dependencies: ``torch``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["IMPORTANCE_SAMPLING_MODES", "sampler_mismatch_counts", "sampler_mismatch_metrics"]

# trl 1.16's vllm_importance_sampling_mode values (GRPOTrainer._generate_and_score_completions); it raises on any other
# only once the first batch is scored.
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampler_mismatch_counts(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """The sums behind :func:`sampler_mismatch_metrics` for one process's batch (sums gather across processes).

    Args:
        trainer_log_probs: ``[B, T]``, the completion tokens' log-probs under the trainer's weights (trl's old
            log-probs).
        sampler_log_probs: ``[B, T]``, the same tokens' log-probs recorded by the sampler (NaN: unknown).
        mask: ``[B, T]``, 1 on the tokens trl's loss counts (completion mask times ``env_mask``).

    Keyword Args:
        mode, clip_min, clip_max: the ``GRPOConfig``'s ``vllm_importance_sampling_*`` settings.

    Returns:
        ``[6]``: the k3 KL summed over tokens with a known sampler log-prob, those tokens, the tokens counted by
        ``mask``, those outside ``[clip_min, clip_max]`` (for ``sequence_*`` modes: every token of a sequence whose
        ratio is), sequences with such a token, sequences with a token counted.
    """
    mask = mask.bool()
    log_ratio = trainer_log_probs.float() - sampler_log_probs.float()  # log(pi_trainer / pi_sampler), x ~ sampler
    known = mask & ~torch.isnan(log_ratio)
    known_log_ratio = torch.where(known, log_ratio, 0.0)
    # k3 (Schulman's): r - 1 - log r >= 0, an unbiased estimate of KL(sampler || trainer) from the sampler's tokens.
    k3 = torch.where(known, torch.expm1(known_log_ratio) - known_log_ratio, 0.0)
    # The ratio as trl 1.16 builds it: unknown tokens count as ratio 1, a sequence's ratio from its summed log-ratio.
    if mode.startswith("sequence_"):
        known_log_ratio = known_log_ratio.sum(-1, keepdim=True)
    ratio = torch.exp(known_log_ratio)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = ((ratio < low) | (ratio > high)).expand_as(mask) & mask
    counted_rows = mask.any(-1)
    return torch.stack(
        [
            k3.sum(),
            known.sum().float(),
            mask.sum().float(),
            outside.sum().float(),
            outside.any(-1).sum().float(),
            counted_rows.sum().float(),
        ]
    )


def sampler_mismatch_metrics(counts: torch.Tensor) -> dict[str, float]:
    """The mismatch figures :func:`sampler_mismatch_counts` adds to trl's own, from its (gathered, summed) counts:

    - ``sampling/sampler_kl_k3``: the mean per-token k3 KL between the sampler's and the trainer's log-probs;
    - ``sampling/importance_sampling_clipped_or_masked/token_fraction``: the share of loss tokens the mode clips
      (``*_truncate``) or masks (``*_mask``);
    - ``sampling/importance_sampling_clipped_or_masked/sequence_fraction``: the share of completions with such a token.

    trl's own (``sampling/sampling_logp_difference/mean`` and ``/max``, ``sampling/importance_sampling_ratio/min``,
    ``/mean``, ``/max``) are logged by trl.

    Examples:
        >>> trainer, sampler = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -math.log(4.0)]])
        >>> mask = torch.ones(1, 2)
        >>> counts = sampler_mismatch_counts(trainer, sampler, mask, mode="token_mask", clip_min=None, clip_max=3.0)
        >>> figures = sampler_mismatch_metrics(counts)
        >>> round(figures["sampling/sampler_kl_k3"], 4)
        0.8069
        >>> figures["sampling/importance_sampling_clipped_or_masked/token_fraction"]
        0.5
    """
    k3, known, tokens, outside_tokens, outside_rows, rows = counts.tolist()
    return {
        "sampling/sampler_kl_k3": k3 / max(known, 1.0),
        "sampling/importance_sampling_clipped_or_masked/token_fraction": outside_tokens / max(tokens, 1.0),
        "sampling/importance_sampling_clipped_or_masked/sequence_fraction": outside_rows / max(rows, 1.0),
    }
