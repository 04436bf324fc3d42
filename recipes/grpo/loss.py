"""GRPO's advantages and policy losses, with trl 1.16's menu and trl's own normalisation of each.

- :func:`group_advantages`: each response's reward against its group's (``advantage.scale_rewards``: ``group``,
  ``batch`` or ``none``, as trl's ``scale_rewards``); :class:`GroupAdvantage` writes them into a batch.
- :class:`GRPOObjective`: the loss of one mini-batch, as the ``loss:`` node sets it (``recipes.grpo.schema.Loss``),
  for every ``loss.type`` of trl (``grpo``, ``bnpo``,
  ``dr_grpo``, ``dapo``, ``cispo``, ``sapo``, ``luspo``, ``vespo``), token- or sequence-level importance sampling
  (GSPO), clip-higher (``clip_epsilon_high``), two-sided clipping (``delta``), the high-entropy token mask
  (``top_entropy_quantile``), the off-policy sequence mask (``off_policy_mask_threshold``) and a KL penalty to the
  reference with trl's ``beta`` semantics: a per-response-token term (``kl_to_ref_coeff``), bias-corrected by the
  importance ratio (``kl_bias_correction``), normalised exactly as the policy term of the loss type; and trl's
  sampler/trainer mismatch correction (``loss.sampler_correction``, trl's ``vllm_importance_sampling_*``).
- :func:`sampler_correction_ratio`: trl's truncated or masked importance weight exp(trainer - sampler log-prob), per
  token or per response; :func:`sampler_mismatch_counts` and :func:`sampler_mismatch_metrics`: how far the sampler's
  log-probs are from the trainer's (``sampling/*`` in metrics.csv, trl's names).
- :data:`LOSS_RULES`: ``loss.type`` -> :class:`LossRule` (its policy loss, normaliser and micro-batch share), the
  one table every type is added to (verl's ``register_policy_loss``, as a table); :data:`POLICY_LOSSES`,
  :data:`NORMALIZERS` and :data:`MICRO_BATCH_SHARES` are its views by rule.

Why not TorchRL's ``GRPOLoss`` (or its ``DAPO``/``CISPOLoss`` subclasses): 0.14.1 aggregates per mini-batch only
(``token_mean``/``prompt_mean``), has no sequence-level ratio, no SAPO/LUSPO/VESPO, no two-sided clip, no entropy or
off-policy masks, and takes the KL term's mean over every position of the ``[B, T]`` batch, prompt and padding
included, which scales the applied coefficient down by the response's share of the sequence. trl's DAPO normalises
by the tokens of the whole accumulated batch, which no per-mini-batch aggregation reproduces. The log-probs and
entropies come from ``recipes.grpo.log_probs`` (response positions only); everything here works on ``[B, R]`` response
columns.

Dependencies: torch, tensordict, accelerate.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate import PartialState
from accelerate.utils import gather, pad_across_processes
from tensordict import TensorDictBase
from torch import nn

from interop.trl.importance_sampling import sampler_mismatch_counts as _ratio_counts
from interop.trl.importance_sampling import sampler_mismatch_metrics as _ratio_metrics
from recipes.grpo.batch import (
    ADVANTAGE,
    ATTENTION_MASK,
    LOG_PROBS,
    LOSS_MASK,
    REF_LOG_PROBS,
    REWARD,
    SAMPLER_LOG_PROBS,
    SOURCE_REWARDS,
    TOKENS,
    response_start,
)
from recipes.grpo.rollout_envs import ROLLOUT_ENVS
from recipes.grpo.schema import (
    GRPORecipeConfig,
    ImportanceSamplingLevel,
    Loss,
    RewardAggregation,
    SamplerCorrection,
    ScaleRewards,
)

__all__ = [
    "IS_LEVELS",
    "LOSS_RULES",
    "LOSS_TYPES",
    "MICRO_BATCH_SHARES",
    "NORMALIZERS",
    "POLICY_LOSSES",
    "SCALE_REWARDS",
    "GRPOObjective",
    "LossRule",
    "GroupAdvantage",
    "group_advantages",
    "make_loss",
    "normalized_sum_advantages",
    "sampler_correction_ratio",
    "sampler_mismatch_counts",
    "sampler_mismatch_metrics",
]

SCALE_REWARDS = typing.get_args(ScaleRewards)
IS_LEVELS = typing.get_args(ImportanceSamplingLevel)
AGGREGATIONS = typing.get_args(RewardAggregation)


# ------------------------------------------------------------------------------------------------ advantages


def _unbiased_std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return values.std(dim=dim) if dim is not None else values.std()


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: str) -> torch.Tensor:
    """Each reward minus its group's mean (``group_size`` contiguous responses per prompt), divided by the standard
    deviation (plus 1e-4) of its group (``scale="group"``), of the whole batch (``"batch"``), or by nothing
    (``"none"``), as trl's ``scale_rewards`` does.

    Examples:
        >>> group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), 2, scale="none")
        tensor([-1.,  1.,  0.,  0.])
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"group_advantages: scale={scale!r}, expected one of {list(SCALE_REWARDS)}.")
    grouped = rewards.reshape(-1, group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "none":
        return centred
    if scale == "group":
        std = _unbiased_std(grouped, dim=1).repeat_interleave(group_size)
    else:
        std = _unbiased_std(rewards).expand_as(rewards)
    return centred / (std + 1e-4)


def _nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased standard deviation of the non-NaN values, over ``dim`` (all of them when None)."""
    dims = tuple(range(values.ndim)) if dim is None else (dim,)
    mean = values.nanmean(dim=dims, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dims, keepdim=keepdim)
    return (((values - mean) ** 2).nansum(dim=dims, keepdim=keepdim) / (count - 1)).sqrt()


def normalized_sum_advantages(values: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """trl's ``multi_objective_aggregation="normalize_then_sum"``: each source's values (``[N, K]``, NaN where a
    source does not apply) standardised within each group, their weighted sum (NaN left out), then standardised
    over the batch (the 1e-4 guard in both).

    Examples:
        >>> values = torch.tensor([[1.0, 0.0], [3.0, 1.0], [5.0, 1.0], [5.0, 0.0]])
        >>> normalized_sum_advantages(values, torch.tensor([1.0, 1.0]), 2)
        tensor([-1.0954,  1.0954,  0.5477, -0.5477])
    """
    grouped = values.reshape(-1, group_size, values.shape[-1])
    mean = grouped.nanmean(dim=1, keepdim=True)
    std = _nanstd(grouped, dim=1, keepdim=True)
    normalized = ((grouped - mean) / (std + 1e-4)).reshape(-1, values.shape[-1])
    rewards = (normalized * weights.to(values)).nansum(dim=-1)
    return (rewards - rewards.nanmean()) / (_nanstd(rewards) + 1e-4)


class GroupAdvantage:
    """Writes GRPO advantages into a batch of whole groups (``group_size`` contiguous responses per prompt, as every
    rollout of the recipe lays them out), shaped like its rewards (``[B, 1, 1]``).

    Args:
        group_size: responses per prompt.

    Keyword Args:
        scale: ``advantage.scale_rewards`` (:func:`group_advantages`).

    Examples:
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({"next": {"reward": torch.tensor([1.0, 3.0, 5.0, 5.0]).view(4, 1, 1)}}, batch_size=[4])
        >>> GroupAdvantage(2, scale="group")(batch)["advantage"].view(-1)
        tensor([-0.7071,  0.7071,  0.0000,  0.0000])
    """

    def __init__(
        self,
        group_size: int,
        *,
        scale: str,
        aggregation: str = "sum_then_normalize",
        weights: torch.Tensor | None = None,
    ) -> None:
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"GroupAdvantage: aggregation={aggregation!r}, expected one of {list(AGGREGATIONS)}.")
        if aggregation == "normalize_then_sum" and weights is None:
            raise ValueError("GroupAdvantage: normalize_then_sum needs the sources' weights.")
        self.group_size = group_size
        self.scale = scale
        self.aggregation = aggregation
        self.weights = weights

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        rewards = batch.get(REWARD)
        if batch.ndim != 1 or batch.shape[0] % self.group_size:
            raise ValueError(
                f"GroupAdvantage: expected a flat batch of whole groups of {self.group_size}, got batch size "
                f"{tuple(batch.batch_size)}."
            )
        if self.aggregation == "normalize_then_sum":
            # trl normalises per source, then over the batch, whatever scale_rewards says.
            values = batch.get(SOURCE_REWARDS).reshape(batch.shape[0], -1).float()
            advantages = normalized_sum_advantages(values, self.weights, self.group_size)
        else:
            advantages = group_advantages(rewards.reshape(-1).float(), self.group_size, scale=self.scale)
        batch.set(ADVANTAGE, advantages.reshape(rewards.shape))
        return batch


# ------------------------------------------------------------------------------------------------ the loss


@dataclass
class _Tokens:
    """One mini-batch in response columns ``[B, R]``: what every loss rule reads."""

    log_probs: torch.Tensor  # the policy's, with gradients
    old_log_probs: torch.Tensor  # the sampling policy's
    entropies: torch.Tensor
    mask: torch.Tensor  # float: the response tokens that count (truncated responses out, when masked)
    advantages: torch.Tensor  # [B, 1]
    log_ratio: torch.Tensor
    coef_1: torch.Tensor  # the importance ratio: [B, R] (token level) or [B, 1] (sequence level)
    sampler_log_probs: torch.Tensor | None = None  # the sampler's, where they differ from old_log_probs' source
    sampler_ratio: torch.Tensor | None = None  # loss.sampler_correction's weight: [B, R] or [B, 1]


def _clipped(tokens: _Tokens, s: Loss) -> torch.Tensor:
    """PPO's clipped surrogate: the ratio clipped to [1 - clip_epsilon, 1 + clip_epsilon_high] (and at ``delta``)."""
    coef_2 = torch.clamp(tokens.coef_1, 1 - s.clip_epsilon, 1 + s.clip_epsilon_high)
    coef_1 = tokens.coef_1 if s.delta is None else torch.clamp(tokens.coef_1, max=s.delta)
    return -torch.min(coef_1 * tokens.advantages, coef_2 * tokens.advantages)


def _cispo(tokens: _Tokens, s: Loss) -> torch.Tensor:
    """CISPO: the ratio itself clipped and detached, weighting the log-prob: every token keeps its gradient."""
    return -torch.clamp(tokens.coef_1, max=s.clip_epsilon_high).detach() * tokens.advantages * tokens.log_probs


def _sapo(tokens: _Tokens, s: Loss) -> torch.Tensor:
    """SAPO: a sigmoid gate of the ratio (its temperature by the advantage's sign) in place of the clip."""
    temperatures = torch.where(tokens.advantages > 0, s.sapo.temperature_pos, s.sapo.temperature_neg)
    return -torch.sigmoid(temperatures * (tokens.coef_1 - 1)) * 4 / temperatures * tokens.advantages


@torch.no_grad()
def _gamma_weights(tokens: _Tokens, s: Loss) -> torch.Tensor:
    """VESPO's phi(w) = e^lambda w^k e^(-lambda w) of the sequence ratio w, in log space (a gradient scale only)."""
    floor = math.log(1e-8)
    seq_log_ratio = (torch.clamp(tokens.log_ratio, -20.0, 20.0) * tokens.mask).sum(-1, keepdim=True)
    if tokens.sampler_ratio is not None:  # the sampler correction joins the sequence ratio (a masked token: the floor)
        seq_log_ratio = seq_log_ratio + torch.clamp(torch.log(tokens.sampler_ratio), floor, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, floor, 20.0)
    positive = tokens.advantages >= 0
    k = torch.where(positive, s.vespo.k_pos, s.vespo.k_neg)
    lam = torch.where(positive, s.vespo.lambda_pos, s.vespo.lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _vespo(tokens: _Tokens, s: Loss) -> torch.Tensor:
    """VESPO: the log-prob weighted by a gamma function of the sequence ratio (:func:`_gamma_weights`)."""
    return -_gamma_weights(tokens, s) * tokens.advantages * tokens.log_probs


@dataclass(frozen=True)
class Scale:
    """What a normaliser needs beyond the mini-batch: the accumulation of one optimizer step, and ``dapo``'s token
    count (the response tokens of one optimizer step's accumulated batch per process, averaged over the step)."""

    accumulation: int
    step_tokens: float


def _sequence_mean(loss: torch.Tensor, mask: torch.Tensor, scale: Scale, max_length: int) -> torch.Tensor:
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / scale.accumulation


def _token_mean(loss: torch.Tensor, mask: torch.Tensor, scale: Scale, max_length: int) -> torch.Tensor:
    return (loss * mask).sum() / mask.sum().clamp(min=1.0) / scale.accumulation


def _constant_length(loss: torch.Tensor, mask: torch.Tensor, scale: Scale, max_length: int) -> torch.Tensor:
    return (loss * mask).sum() / (loss.shape[0] * max_length) / scale.accumulation


def _step_tokens(loss: torch.Tensor, mask: torch.Tensor, scale: Scale, max_length: int) -> torch.Tensor:
    return (loss * mask).sum() / max(scale.step_tokens, 1.0)


def _sequence_sum(loss: torch.Tensor, mask: torch.Tensor, scale: Scale, max_length: int) -> torch.Tensor:
    return (loss * mask).sum(-1).mean() / scale.accumulation


def _row_share(micro_mask: torch.Tensor, whole_mask: torch.Tensor) -> float:
    return micro_mask.shape[0] / whole_mask.shape[0]


def _token_share(micro_mask: torch.Tensor, whole_mask: torch.Tensor) -> float:
    return float(micro_mask.sum()) / max(float(whole_mask.sum()), 1.0)


def _whole(micro_mask: torch.Tensor, whole_mask: torch.Tensor) -> float:
    return 1.0


@dataclass(frozen=True)
class LossRule:
    """One ``loss.type``: its per-token policy loss (before masks, the KL term and the normaliser), how it turns
    per-token losses into the mini-batch's loss (trl's normalisation; the gradients of an optimizer step's accumulated
    mini-batches add up, as trl's do), and what share of a mini-batch's loss one of its micro-batches carries under
    that normaliser (``train.max_tokens_per_micro_batch``: the micro-batches' losses times their shares add up to the
    mini-batch's; per-response means count rows, bnpo's token mean tokens, dapo's step-token normaliser is already the
    whole step's). ``summary``: what the type is, for people (docs/grpo.md and the YAML comment name every type)."""

    policy_loss: Callable[[_Tokens, Loss], torch.Tensor]
    normalizer: Callable[[torch.Tensor, torch.Tensor, Scale, int], torch.Tensor]
    micro_batch_share: Callable[[torch.Tensor, torch.Tensor], float]
    summary: str


# Every loss.type, in trl's loss_type order: adding one is a row here (its rules above), its name in
# recipes.grpo.schema.LossType, the loss.type comment of conf/grpo_torchrl_rm.yaml and docs/grpo.md
# (tests/recipes/grpo/test_loss_registry.py holds the four together). verl's register_policy_loss, as a table.
LOSS_RULES: dict[str, LossRule] = {
    "grpo": LossRule(_clipped, _sequence_mean, _row_share, "PPO's clipped ratio, each response's token mean"),
    "bnpo": LossRule(_clipped, _token_mean, _token_share, "PPO's clipped ratio, the mini-batch's token mean"),
    "dr_grpo": LossRule(
        _clipped, _constant_length, _row_share, "PPO's clipped ratio over a constant length (max_new_tokens)"
    ),
    "dapo": LossRule(_clipped, _step_tokens, _whole, "PPO's clipped ratio over the optimizer step's tokens"),
    "luspo": LossRule(_clipped, _sequence_sum, _row_share, "PPO's clipped ratio, each response's token sum"),
    "cispo": LossRule(_cispo, _step_tokens, _whole, "the clipped, detached ratio weighting each token's log-prob"),
    "sapo": LossRule(_sapo, _sequence_mean, _row_share, "a sigmoid gate of the ratio in place of its clip"),
    "vespo": LossRule(_vespo, _step_tokens, _whole, "a gamma weight of the sequence ratio on each log-prob"),
}
LOSS_TYPES = tuple(LOSS_RULES)
# Views of the table by rule, for the code that reads one rule of the current type.
POLICY_LOSSES = {name: rule.policy_loss for name, rule in LOSS_RULES.items()}
NORMALIZERS = {name: rule.normalizer for name, rule in LOSS_RULES.items()}
MICRO_BATCH_SHARES = {name: rule.micro_batch_share for name, rule in LOSS_RULES.items()}


def _high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The trained tokens whose entropy is at or above the ``1 - quantile`` quantile of every process's trained
    tokens of this mini-batch."""
    local = entropies[mask.bool()].detach().float()
    if PartialState().use_distributed:
        local = gather(pad_across_processes(local, dim=0, pad_index=-1e9))
        local = local[local != -1e9]  # entropies are never negative: the padding cannot collide with one
    if local.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(local, 1 - quantile)
    return ((entropies * mask) >= threshold) & mask.bool()


def _off_policy_mask(tokens: _Tokens, threshold: float) -> torch.Tensor:
    """``[B, 1]``: keep a response unless its advantage is negative and its mean KL to the sampling policy
    (``sampler - current``, over its trained tokens; the sampler's log-probs are the old ones unless the sampler
    correction keeps them apart) exceeds ``threshold``."""
    sampler = tokens.old_log_probs if tokens.sampler_log_probs is None else tokens.sampler_log_probs
    kl = (sampler - tokens.log_probs.detach()).nan_to_num(nan=0.0)
    mean_kl = (kl * tokens.mask).sum(-1, keepdim=True) / tokens.mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((tokens.advantages >= 0) | (mean_kl <= threshold)).to(tokens.mask.dtype)


def sampler_correction_ratio(
    trainer_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor, mask: torch.Tensor, settings: SamplerCorrection
) -> torch.Tensor:
    """trl's ``vllm_importance_sampling_*`` weight: exp(trainer - sampler log-prob) over the ``mask``ed tokens (1
    elsewhere, and where the sampler's is unknown: NaN), per token (``token_*``: ``[B, R]``) or per response from its
    summed log-ratio (``sequence_*``: ``[B, 1]``), clipped into ``[clip_min, clip_max]`` (``*_truncate``) or zeroed
    outside it (``*_mask``); a null bound is no bound.

    Examples:
        >>> from recipes.grpo.schema import SamplerCorrection
        >>> trainer, sampler = torch.zeros(1, 3), torch.tensor([[0.0, -2.0, 0.3]])
        >>> mask = torch.ones(1, 3)
        >>> sampler_correction_ratio(trainer, sampler, mask, SamplerCorrection(True, "token_mask", 0.5, 3.0))
        tensor([[1.0000, 0.0000, 0.7408]])
        >>> sampler_correction_ratio(trainer, sampler, mask, SamplerCorrection(True, "sequence_truncate", None, 2.0))
        tensor([[2.]])
    """
    log_ratio = torch.where(mask.bool(), trainer_log_probs - sampler_log_probs, 0.0).nan_to_num(nan=0.0)
    if settings.mode.startswith("sequence_"):
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if settings.mode.endswith("_truncate"):
        return torch.clamp(ratio, min=settings.clip_min, max=settings.clip_max)
    low = -math.inf if settings.clip_min is None else settings.clip_min
    high = math.inf if settings.clip_max is None else settings.clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampler_mismatch_counts(
    trainer_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor, mask: torch.Tensor, settings: SamplerCorrection
) -> torch.Tensor:
    """``[8]``: the sums behind :func:`sampler_mismatch_metrics` for one mini-batch (they add up over mini-batches
    and processes, but the second, a maximum): the summed and the largest |trainer - sampler log-prob| over the
    ``mask``ed tokens whose sampler log-prob is known, then ``interop.trl.trainer.sampler_mismatch_counts``' six (k3 KL,
    tokens known, tokens, tokens and responses outside the clip range, responses)."""
    difference = (trainer_log_probs.float() - sampler_log_probs.float()).abs()
    known = mask.bool() & ~torch.isnan(difference)
    difference = torch.where(known, difference, 0.0)
    ratio_counts = _ratio_counts(
        trainer_log_probs,
        sampler_log_probs,
        mask,
        mode=settings.mode,
        clip_min=settings.clip_min,
        clip_max=settings.clip_max,
    )
    largest = difference.max() if difference.numel() else difference.new_zeros(())
    return torch.cat([torch.stack([difference.sum(), largest]), ratio_counts.to(difference)])


def sampler_mismatch_metrics(counts: torch.Tensor) -> dict[str, float]:
    """The step's mismatch figures, trl's names, from :func:`sampler_mismatch_counts` combined over its mini-batches:
    ``sampling/sampling_logp_difference/mean`` and ``/max`` (|trainer - sampler log-prob| per token),
    ``sampling/sampler_kl_k3`` (the mean k3 estimate of KL(sampler || trainer) per token) and
    ``sampling/importance_sampling_clipped_or_masked/token_fraction`` and ``/sequence_fraction`` (the share of loss
    tokens, and of responses, whose ``loss.sampler_correction`` ratio falls outside ``[clip_min, clip_max]``).

    Examples:
        >>> counts = torch.tensor([0.5, 0.4, 0.2, 2.0, 2.0, 1.0, 1.0, 2.0])
        >>> sampler_mismatch_metrics(counts)["sampling/sampling_logp_difference/mean"]
        0.25
    """
    absolute, largest = counts[:2].tolist()
    known = float(counts[3])
    return {
        "sampling/sampling_logp_difference/mean": absolute / max(known, 1.0),
        "sampling/sampling_logp_difference/max": largest,
        **_ratio_metrics(counts[2:]),
    }


def combine_mismatch_counts(counts: list[torch.Tensor]) -> torch.Tensor:
    """:func:`sampler_mismatch_counts` of several mini-batches (or processes: ``[N, 8]``) as one: sums, and the
    largest difference."""
    stacked = torch.stack(counts) if isinstance(counts, list) else counts
    combined = stacked.sum(0)
    combined[1] = stacked[:, 1].max()
    return combined


class GRPOObjective(nn.Module):
    """The GRPO loss of a dense ``[B, T]`` mini-batch (``recipes.grpo.batch``), as the ``loss:`` node sets it.

    It reads the sequences, the attention mask, the loss mask (the response tokens that count), the old (sampling)
    log-probs (missing: on-policy, the current ones detached stand in, as trl does with one update per generation),
    the reference's log-probs (with a KL term) and the advantages, scores the policy's log-probs and entropies over the
    response positions only, and returns the loss to back-propagate with its diagnostics.

    Args:
        scorer: a ``ResponseLogProbs`` over the policy (or a DDP/FSDP2 form of one: ``make_policy_scorer``).
        settings: the ``loss:`` node (``recipes.grpo.schema.Loss``: trl's ``GRPOConfig`` names in its YAML).

    Keyword Args:
        max_completion_length: ``dr_grpo``'s constant normaliser (trl's ``max_completion_length``; the recipe's
            ``rollout.generation.max_new_tokens``).
        sampler_log_probs_recorded: the batches' ``LOG_PROBS`` are the sampler's own record (``rollout.env=prompt``;
            TorchRL's chat wrapper zeroes the first one of each response): the sampler mismatch is measured only then.
    """

    def __init__(
        self,
        scorer: nn.Module,
        settings: Loss,
        *,
        max_completion_length: int,
        sampler_log_probs_recorded: bool = True,
    ) -> None:
        super().__init__()
        if settings.type not in POLICY_LOSSES:
            raise ValueError(f"GRPOObjective: type={settings.type!r}, expected one of {list(LOSS_TYPES)}.")
        if settings.importance_sampling_level not in IS_LEVELS:
            raise ValueError(f"GRPOObjective: importance_sampling_level must be one of {list(IS_LEVELS)}.")
        self.scorer = scorer
        self.settings = settings
        self.max_completion_length = max_completion_length
        self.sampler_log_probs_recorded = sampler_log_probs_recorded

    def forward(self, batch: TensorDictBase, *, scale: Scale, fresh: bool = False) -> dict[str, torch.Tensor]:
        """The mini-batch's loss and diagnostics; ``fresh``: the policy has not been updated since the step began
        (its log-probs are then the trainer's of the sampling step: with the correction off, the mismatch is measured
        against them, ``sampler_mismatch`` in the output)."""
        s = self.settings
        tokens = self._tokens(batch)
        per_token = POLICY_LOSSES[s.type](tokens, s)
        if s.off_policy_mask_threshold is not None:
            per_token = per_token * _off_policy_mask(tokens, s.off_policy_mask_threshold)
        entropy_mask = None
        if s.top_entropy_quantile < 1.0:
            entropy_mask = _high_entropy_mask(tokens.entropies, tokens.mask, s.top_entropy_quantile)
            per_token = per_token * entropy_mask
        if tokens.sampler_ratio is not None and s.type != "vespo":  # vespo weighs it into its own (_gamma_weights)
            per_token = per_token * tokens.sampler_ratio
        kl = None
        if s.kl_to_ref_coeff:
            kl = self._kl(batch, tokens)
            per_token = per_token + s.kl_to_ref_coeff * kl
        loss = NORMALIZERS[s.type](per_token, tokens.mask, scale, self.max_completion_length)
        out = {"policy_loss": loss.detach(), "entropy": _masked_mean(tokens.entropies.detach(), tokens.mask)}
        if s.entropy_coeff:
            trained = tokens.mask if entropy_mask is None else tokens.mask * entropy_mask
            loss = loss - s.entropy_coeff * _masked_mean(tokens.entropies, trained) / scale.accumulation
        out["loss"] = loss
        if kl is not None:
            out["kl_to_ref"] = _masked_mean(kl.detach().expand_as(tokens.mask), tokens.mask)
        out.update(self._clip_fractions(tokens))
        mismatch = self._mismatch(batch, tokens, fresh=fresh)
        if mismatch is not None:
            out["sampler_mismatch"] = mismatch
        return out

    def _mismatch(self, batch: TensorDictBase, tokens: _Tokens, *, fresh: bool) -> torch.Tensor | None:
        """:func:`sampler_mismatch_counts` where the trainer's and the sampler's log-probs of the batch are both
        known: with the correction on, always; off, while the policy is the one that began the step (``fresh``)."""
        if tokens.sampler_log_probs is not None:
            trainer, sampler = tokens.old_log_probs, tokens.sampler_log_probs
        elif fresh and self.sampler_log_probs_recorded and batch.get(LOG_PROBS, None) is not None:
            trainer, sampler = tokens.log_probs.detach(), tokens.old_log_probs
        else:
            return None
        return sampler_mismatch_counts(trainer, sampler, tokens.mask, self.settings.sampler_correction)

    def _tokens(self, batch: TensorDictBase) -> _Tokens:
        s = self.settings
        start = response_start(batch)
        log_probs, entropies = self.scorer(
            batch.get(TOKENS), batch.get(ATTENTION_MASK).bool(), response_start=start, with_entropy=True
        )
        log_probs, entropies = log_probs[:, start:], entropies[:, start:]
        mask = batch.get(LOSS_MASK).float()
        old = batch.get(LOG_PROBS, None)
        old = log_probs.detach() if old is None else old[:, start:]
        sampler = sampler_ratio = None
        if s.sampler_correction.enabled:
            # The ratio below is to the trainer's own log-probs of the sampling policy (old); this weighs the rest.
            sampler = batch.get(SAMPLER_LOG_PROBS)[:, start:]
            sampler_ratio = sampler_correction_ratio(old, sampler, mask, s.sampler_correction)
        # Zero off the mask: a dialog's tool tokens carry no sampling log-prob (0), and a ratio or KL term built on
        # them could overflow to inf, whose product with a mask of 0 is NaN in the loss and its gradient.
        log_ratio = torch.where(mask.bool(), log_probs - old, 0.0)
        if s.importance_sampling_level == "token":
            log_weights = log_ratio
        else:  # GSPO: one ratio per response, the mean of its tokens' log-ratios
            log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        advantages = batch.get(ADVANTAGE).reshape(-1, 1).to(log_probs.dtype)
        return _Tokens(
            log_probs, old, entropies, mask, advantages, log_ratio, torch.exp(log_weights), sampler, sampler_ratio
        )

    def _kl(self, batch: TensorDictBase, tokens: _Tokens) -> torch.Tensor:
        """The k3 estimate of KL(policy || reference) per response token, times the importance ratio when
        bias-corrected (the tokens were sampled by the old policy)."""
        difference = batch.get(REF_LOG_PROBS)[:, response_start(batch) :] - tokens.log_probs
        difference = torch.where(tokens.mask.bool(), difference, 0.0)  # exp() of an unmasked tool token could be inf
        kl = torch.exp(difference) - difference - 1
        return kl * tokens.coef_1 if self.settings.kl_bias_correction else kl

    def _clip_fractions(self, tokens: _Tokens) -> dict[str, torch.Tensor]:
        s, ratio, advantages = self.settings, tokens.coef_1.detach(), tokens.advantages
        if s.type == "cispo":
            return {"clip_fraction": _masked_mean(((ratio > s.clip_epsilon_high) & (advantages > 0)).float(), tokens)}
        if POLICY_LOSSES[s.type] is not _clipped:
            return {}
        low = ((ratio < 1 - s.clip_epsilon) & (advantages < 0)).float()
        high = ((ratio > 1 + s.clip_epsilon_high) & (advantages > 0)).float()
        return {
            "clip_fraction": _masked_mean(torch.maximum(low, high), tokens),
            "clip_fraction_low": _masked_mean(low, tokens),
            "clip_fraction_high": _masked_mean(high, tokens),
        }


def _masked_mean(values: torch.Tensor, mask) -> torch.Tensor:
    """A token mean over ``mask`` (a ``[B, R]`` mask, or the tokens' own): a per-response value counts once per
    response when ``values`` is ``[B, 1]``."""
    mask = mask.mask if isinstance(mask, _Tokens) else mask
    if values.shape[-1] == 1 and mask.shape[-1] != 1:
        return values.sum() / max(values.shape[0], 1)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def make_loss(cfg: GRPORecipeConfig, scorer: nn.Module) -> GRPOObjective:
    """The :class:`GRPOObjective` of the recipe's ``loss:`` node, over the policy's ``scorer``."""
    return GRPOObjective(
        scorer,
        cfg.loss,
        max_completion_length=cfg.rollout.generation["max_new_tokens"],
        sampler_log_probs_recorded=ROLLOUT_ENVS[cfg.rollout.env].records_sampler_log_probs,
    )
