"""The learner's side of a GRPO step: complete the batch, update the policy over mini-batches.

- :class:`Learner` and :func:`make_learner`: the batch preparation, replay buffer, loss, optimizer and its learning
  rate schedule, the parameters it clips, the context of each loss forward and the reference to keep in sync, built
  from the config and the loaded models.
- :class:`PrepareBatch`: group advantages (``advantage.scale_rewards``), the loss mask (the policy's own tokens, a
  dialog's tool messages out; ``loss.mask_truncated_completions``), then the reference's (and, where a batch lacks
  them or ``loss.sampler_correction`` keeps the sampler's apart, and a step makes several updates, the old policy's)
  log-probs over the response positions.
- :func:`informative_batch`: DAPO's dynamic sampling (``advantage.filter_zero_std_groups``): groups whose rewards all
  tie are dropped and more are drawn, up to ``advantage.max_extra_batches`` batches.
- :func:`optimize`: ``train.epochs_per_step`` passes over the step's responses, ``train.gradient_accumulation_steps``
  mini-batches per optimizer step; the step's sampler/trainer mismatch (``sampling/*``) over every process's batch.

Dependencies: torch, tensordict, torchrl, hydra, transformers, accelerate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import PartialState
from hydra.utils import instantiate
from tensordict import TensorDictBase
from torch.nn.parallel import DistributedDataParallel
from torchrl.data import ReplayBuffer, SamplerWithoutReplacement, TensorStorage

from recipes.common.config import RunStopped
from recipes.common.sharding import is_sharded, shard_frozen_model
from recipes.grpo.batch import (
    ATTENTION_MASK,
    LOG_PROBS,
    LOSS_MASK,
    REF_LOG_PROBS,
    REWARD,
    SAMPLER_LOG_PROBS,
    TOKENS,
    TRUNCATED,
    merge_batches,
    policy_token_mask,
    response_start,
)
from recipes.grpo.distributed import pool_over_processes
from recipes.grpo.log_probs import (
    ResponseLogProbs,
    ScoreLogProbs,
    distinct_prompts,
    make_policy_scorer,
    make_reference_scorer,
)
from recipes.grpo.loss import (
    MICRO_BATCH_SHARES,
    GroupAdvantage,
    GRPOObjective,
    Scale,
    combine_mismatch_counts,
    make_loss,
    sampler_mismatch_metrics,
)
from recipes.grpo.policy import enable_activation_checkpointing, trainable_parameters, update_forward
from recipes.grpo.rewards import reward_sources
from recipes.grpo.rollout_envs import ROLLOUT_ENVS
from recipes.grpo.schema import GRPORecipeConfig

__all__ = [
    "Learner",
    "PrepareBatch",
    "check_weights_finite",
    "informative_batch",
    "make_learner",
    "make_replay_buffer",
    "optimize",
    "optimizer_steps",
    "token_micro_batches",
]


class PrepareBatch:
    """The learner's side of a step: group advantages, the loss mask, then the log-probs a batch still needs, in
    place.

    Args:
        group_size: responses per prompt (each batch holds whole groups).

    Keyword Args:
        scale_rewards: ``advantage.scale_rewards`` (``group``, ``batch`` or ``none``).
        mask_truncated: leave the responses that hit ``max_new_tokens`` out of the loss
            (``loss.mask_truncated_completions``).
        reference: a ``ResponseLogProbs`` over the frozen reference model, or ``None`` (no KL term).
        policy: a ``ResponseLogProbs`` over the policy, to score the old log-probs of batches whose collector records
            none usable (TorchRL's ``TransformersWrapper``) when a step makes several updates; ``None``: the batch
            carries them, or is trained on-policy (the loss takes its own log-probs).
        micro_batch_size: sequences per scoring forward pass; ``None``: all at once.
        aggregation: ``reward.aggregation``; weights: the reward sources' weights (``normalize_then_sum`` only).
        keep_sampler_log_probs: ``loss.sampler_correction.enabled``: the sampler's log-probs move to
            ``SAMPLER_LOG_PROBS``, and the old ones are the trainer's (scored with ``policy``, or, without it, the
            loss's own, as trl's are with one update per batch).
    """

    def __init__(
        self,
        group_size: int,
        *,
        scale_rewards: str,
        mask_truncated: bool,
        reference: ResponseLogProbs | None,
        policy: ResponseLogProbs | None = None,
        micro_batch_size: int | None = None,
        aggregation: str = "sum_then_normalize",
        weights: torch.Tensor | None = None,
        keep_sampler_log_probs: bool = False,
    ) -> None:
        self.advantage = GroupAdvantage(group_size, scale=scale_rewards, aggregation=aggregation, weights=weights)
        self.mask_truncated = mask_truncated
        self.keep_sampler_log_probs = keep_sampler_log_probs
        self.reference = None
        if reference is not None:
            self.reference = ScoreLogProbs(reference, out_key=REF_LOG_PROBS, micro_batch_size=micro_batch_size)
        self.policy = ScoreLogProbs(policy, out_key=LOG_PROBS, micro_batch_size=micro_batch_size) if policy else None

    def __call__(self, batch: TensorDictBase) -> dict[str, float]:
        """Completes ``batch`` in place; returns how long it took (``advantage_s``, ``log_probs_s``)."""
        start = time.perf_counter()
        self.advantage(batch)
        # The policy's own tokens: a dialog's tool messages were not sampled, so no loss, KL or entropy term sees them.
        mask = policy_token_mask(batch)
        if self.mask_truncated:
            mask = mask & ~batch.get(TRUNCATED).reshape(-1, 1)
        batch.set(LOSS_MASK, mask)
        scored = time.perf_counter()
        if self.reference is not None:
            self.reference(batch)
        if self.keep_sampler_log_probs:
            batch.rename_key_(LOG_PROBS, SAMPLER_LOG_PROBS)
        if self.policy is not None:
            self.policy(batch)
        return {"advantage_s": scored - start, "log_probs_s": time.perf_counter() - scored}


@dataclass
class Learner:
    """What updates the policy: the batch preparation (advantages, loss mask, reference log-probs), the replay buffer
    of the step being trained (:func:`make_replay_buffer`; ``None`` between steps), the loss (over the policy's log-prob
    scorer, DDP-wrapped under a launcher), the optimizer, its learning-rate schedule and the parameters it clips, the
    context of each loss forward (``train.mixed_precision``, ``train.gradient_checkpointing``), and the reference model
    kept in sync with the policy (``loss.sync_ref_model``: TR-DPO), if any."""

    prepare: PrepareBatch
    buffer: Any
    loss: GRPOObjective
    optimizer: torch.optim.Optimizer
    scheduler: Any
    parameters: list
    forward_context: Any = contextlib.nullcontext
    policy: Any = None
    synced_reference: Any = None
    optimizer_steps_done: int = 0


def make_learner(cfg: GRPORecipeConfig, models) -> Learner:
    """The :class:`Learner` of ``models`` (the policy, and the frozen reference and reward model, if loaded here).

    The policy's log-probs over the response positions go through DDP or FSDP2 (which shards the policy here, before
    the optimizer sees its parameters), so that the loss's backward averages the gradients over the ranks;
    checkpointing is set on the layers first. Under FSDP2 the frozen reference and reward model are sharded too, 1/N
    of each per process (every process scores as many micro-batches as the others, so their gathers match)."""
    if cfg.train.gradient_checkpointing:
        enable_activation_checkpointing(models.policy)
    scorer = make_policy_scorer(
        models.policy, strategy=cfg.distributed.strategy, device=cfg.device, share_prompt=cfg.train.share_prompt
    )
    if is_sharded(models.policy):
        for frozen in (models.reference, models.reward_model):
            if frozen is not None:
                shard_frozen_model(frozen)
    parameters = trainable_parameters(models.policy)  # all, or LoRA's adapters; a list: clipped at every update
    optimizer = instantiate(dataclasses.asdict(cfg.optimizer))(parameters)
    return Learner(
        prepare=make_batch_preparation(cfg, models, scorer),
        buffer=None,  # each step's: make_replay_buffer
        loss=make_loss(cfg, scorer),
        optimizer=optimizer,
        scheduler=make_scheduler(cfg, optimizer),
        parameters=parameters,
        forward_context=functools.partial(
            update_forward, models.policy, mixed_precision=cfg.train.mixed_precision, device=cfg.device
        ),
        policy=models.policy,
        synced_reference=models.reference if cfg.loss.sync_ref_model else None,
    )


def optimizer_steps(cfg: GRPORecipeConfig) -> int:
    """Optimizer steps per pass over a step's responses: ``train.gradient_accumulation_steps`` mini-batches each."""
    return cfg.rollout.responses_per_step // (cfg.train.mini_batch_size * cfg.train.gradient_accumulation_steps)


def make_scheduler(cfg: GRPORecipeConfig, optimizer: torch.optim.Optimizer):
    """``train.lr_scheduler`` through ``transformers.get_scheduler``, over every optimizer step of the run, with
    ``train.warmup_steps`` steps of warmup (a float in [0, 1): that fraction of them, as transformers reads it)."""
    total = cfg.train.steps * cfg.train.epochs_per_step * optimizer_steps(cfg)
    warmup = cfg.train.warmup_steps
    warmup = math.ceil(total * warmup) if isinstance(warmup, float) else int(warmup)
    from transformers import get_scheduler  # 0.7 s with the Trainer utilities (rewards.make_reward_transform)

    return get_scheduler(cfg.train.lr_scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total)


def make_replay_buffer(cfg: GRPORecipeConfig, batch: TensorDictBase) -> ReplayBuffer:
    """One step's responses (``batch``, dense, with their advantages), handed out in mini-batches without replacement,
    in an order drawn from the buffer's own generator (:func:`optimize` seeds it every step).

    A ``TensorStorage`` over the batch as it is: a mini-batch indexes its rows. A ``LazyStackStorage`` filled with
    it would split it into a TensorDict per row, that each mini-batch stacks again, for the same rows in the same
    order (64 rows of the tiny policy's step, one thread, loaded machine: 4.6-14.7 against 0.9-1.8 ms a step)."""
    return ReplayBuffer(
        storage=TensorStorage(batch),
        sampler=SamplerWithoutReplacement(),
        batch_size=cfg.train.mini_batch_size,
        generator=torch.Generator(),
    )


def mini_batch_order_seed(cfg: GRPORecipeConfig, learner: Learner) -> int:
    """The seed of a step's mini-batch order: the run's seed, the process and the optimizer steps done. Drawn apart
    from torch's global generator, the order neither consumes nor depends on the sampling noise: a sync run's
    sampler, which shares the learner's process, draws what an async collector draws in its own (a zero-lag async run
    trains as the sync run), and a resumed run draws as the uninterrupted one (the optimizer steps are checkpointed)."""
    return cfg.seed * 1_000_003 + PartialState().process_index * 7919 + learner.optimizer_steps_done


def is_on_policy(cfg: GRPORecipeConfig) -> bool:
    """One update per step: the responses train the very policy that sampled them, old log-probs = current ones."""
    return cfg.train.epochs_per_step == 1 and optimizer_steps(cfg) == 1


def make_batch_preparation(cfg: GRPORecipeConfig, models, scorer) -> PrepareBatch:
    """Advantages, the loss mask and reference log-probs; the old log-probs too where the collector records none
    (``chat``) or the sampler correction wants the trainer's (trl scores them too), and a step makes several updates.
    On-policy, the loss takes its own (as trl does with one update per batch)."""
    correction = cfg.loss.sampler_correction.enabled
    recorded = ROLLOUT_ENVS[cfg.rollout.env].records_sampler_log_probs
    scores_old = (not recorded or correction) and not is_on_policy(cfg)
    reference = None
    if cfg.loss.kl_to_ref_coeff:
        reference = make_reference_scorer(
            models.reference, policy=models.policy, policy_scorer=scorer, share_prompt=cfg.train.share_prompt
        )
    return PrepareBatch(
        cfg.rollout.group_size,
        scale_rewards=cfg.advantage.scale_rewards,
        mask_truncated=cfg.loss.mask_truncated_completions,
        reference=reference,
        policy=scorer if scores_old else None,
        micro_batch_size=cfg.rollout.log_prob_micro_batch_size,
        aggregation=cfg.reward.aggregation,
        weights=torch.tensor([source.weight for source in reward_sources(cfg)]),
        keep_sampler_log_probs=correction,
    )


# ------------------------------------------------------------------------------------------------ dynamic sampling


def _any_process(flag: bool) -> bool:
    if not PartialState().use_distributed:
        return flag
    value = torch.tensor([float(flag)], device=PartialState().device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def informative_batch(first: TensorDictBase, batches, *, group_size: int, max_extra_batches: int, pad_token_id: int):
    """DAPO's dynamic sampling: the groups of ``first`` whose rewards do not all tie, topped up from ``batches`` (the
    collector's next batches) until there are as many responses as in ``first``; every process draws as many
    batches as the one that needs most (their collectives stay in step).

    Returns:
        ``(batch, drawn, filtered)``: the batch to train on (informative groups only), every batch drawn (for the
        step's metrics and token count), and how many groups were dropped.

    Raises:
        RunStopped: still short after ``max_extra_batches`` more batches (every group ties: a reward that cannot tell
            responses apart, or a task the policy always or never solves).
    """
    wanted = first.shape[0]
    drawn, kept, filtered = [first], [], 0
    while True:
        rewards = drawn[-1].get(REWARD).reshape(-1, group_size)
        informative = (rewards.max(-1).values != rewards.min(-1).values).repeat_interleave(group_size)
        kept.append(drawn[-1][informative])
        filtered += int((~informative).sum()) // group_size
        have = sum(part.shape[0] for part in kept)
        if not _any_process(have < wanted):
            break
        if len(drawn) > max_extra_batches:
            raise RunStopped(
                f"advantage.filter_zero_std_groups: after {len(drawn)} batches, only {have} of {wanted} responses "
                f"came from groups whose rewards differ ({filtered} groups dropped): the rewards cannot tell this "
                "policy's responses apart. Check the reward sources, raise rollout.generation.temperature or "
                "advantage.max_extra_batches, or set advantage.filter_zero_std_groups=false."
            )
        drawn.append(next(batches))
    return merge_batches(kept, pad_token_id=pad_token_id)[:wanted], drawn, filtered


# ------------------------------------------------------------------------------------------------ the update


# The settings that drive each value, named when it stops being finite.
_DRIVERS = {
    "loss": "the rewards (their sources), loss.clip_epsilon, loss.kl_to_ref_coeff and optimizer.lr",
    "gradient norm": "optimizer.lr and train.max_grad_norm (the loss was finite)",
    "weights": "optimizer.lr (and train.max_grad_norm)",
}


def _stop_unless_finite(value: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(value.detach()).all()):
        raise RunStopped(
            f"The policy's {what} is {float(value.detach().float().flatten()[0])}: training on would save garbage, so "
            f"the run stops here (no checkpoint is written after it). What drives it: {_DRIVERS[what]}. Lower "
            "optimizer.lr, or check the reward sources, then start again or resume=true from the last checkpoint."
        )


def check_weights_finite(parameters: list) -> None:
    """Stops the run (before a checkpoint is written) if a trainable weight is no longer finite."""
    with torch.no_grad():
        norms = torch._foreach_norm([p.detach() for p in parameters])
    _stop_unless_finite(torch.stack(norms).float().sum(), "weights")


def step_scale(cfg: GRPORecipeConfig, batch: TensorDictBase) -> Scale:
    """The normalisation of this step's mini-batches: the accumulation, and ``dapo``'s response tokens of one
    optimizer step per process (every process's loss-mask tokens of the step, averaged per process and step)."""
    tokens = pool_over_processes(batch.get(LOSS_MASK).sum().reshape(1).float()).sum()
    processes = PartialState().num_processes
    return Scale(cfg.train.gradient_accumulation_steps, float(tokens) / processes / optimizer_steps(cfg))


def optimize(cfg: GRPORecipeConfig, learner: Learner, batch: TensorDictBase) -> dict[str, float]:
    """``train.epochs_per_step`` passes over the step's responses (in ``learner.buffer``), each optimizer step
    accumulating ``train.gradient_accumulation_steps`` mini-batches; returns the optimizer steps' mean diagnostics.

    Each loss forward runs in ``learner.forward_context()`` (bf16 autocast, checkpointed layers), its backward
    outside it; the learning-rate schedule steps with the optimizer."""
    scale = step_scale(cfg, batch)
    learner.buffer.set_rng(torch.Generator().manual_seed(mini_batch_order_seed(cfg, learner)))
    sums: dict[str, float] = {}
    mismatch: list[torch.Tensor] = []
    for update in range(cfg.train.epochs_per_step * optimizer_steps(cfg)):
        # The first pass sees each response once: the mismatch is counted there.
        values = _accumulate(
            cfg, learner, scale, fresh=update == 0, mismatch=mismatch if update < optimizer_steps(cfg) else None
        )
        # null or 0: no clipping (trl's meaning of 0), but the norm is still measured (train/grad_norm).
        grad_norm = torch.nn.utils.clip_grad_norm_(learner.parameters, cfg.train.max_grad_norm or math.inf)
        _stop_unless_finite(grad_norm, "gradient norm")
        values["train/lr"] = learner.optimizer.param_groups[0]["lr"]
        learner.optimizer.step()
        learner.scheduler.step()
        # The LM head's gradient is kept for the next backward to write into (a scorer that keeps none: no-op).
        recycle = getattr(learner.loss.scorer, "recycle_head_gradient", None)
        if recycle is not None:
            recycle()
        learner.optimizer.zero_grad(set_to_none=True)
        learner.optimizer_steps_done += 1
        _sync_reference(cfg, learner)
        values["train/grad_norm"] = float(grad_norm)
        for key, value in values.items():
            sums[key] = sums.get(key, 0.0) + value
    steps = cfg.train.epochs_per_step * optimizer_steps(cfg)
    return {key: total / steps for key, total in sums.items()} | step_mismatch(mismatch)


def step_mismatch(mismatch: list[torch.Tensor]) -> dict[str, float]:
    """The step's ``sampling/*`` figures over every process's mini-batches that measured them (every process
    measures as many: the same config); none where none did."""
    if not mismatch:
        return {}
    local = combine_mismatch_counts(mismatch)
    return sampler_mismatch_metrics(combine_mismatch_counts(pool_over_processes(local.reshape(1, -1))))


def token_micro_batches(batch: TensorDictBase, max_tokens: int | None) -> list[TensorDictBase]:
    """``batch`` cut into micro-batches of at most ``max_tokens`` tokens each (prompt and response, pads not counted;
    a longer sequence alone), its rows first ordered by prompt so that each group's rows share a micro-batch (and
    their prompt pass, ``train.share_prompt``); ``None``: the whole batch.

    Examples:
        >>> from tensordict import TensorDict
        >>> full = torch.tensor([[1, 5, 6], [2, 5, 0], [1, 7, 0]])  # prompts 1, 2, 1 of one token; 0 pads
        >>> batch = TensorDict({"tokens": {"prompt": full[:, :1], "full": full},
        ...                     "masks": {"all_attention_mask": full > 0}}, batch_size=[3])
        >>> [part["tokens", "full"][:, 0].tolist() for part in token_micro_batches(batch, 5)]
        [[1, 1], [2]]
    """
    if max_tokens is None:
        return [batch]
    _, prompts = distinct_prompts(batch.get(TOKENS), batch.get(ATTENTION_MASK), response_start(batch))
    batch = batch[torch.argsort(prompts, stable=True)]
    parts, first, used = [], 0, 0
    for row, length in enumerate(batch.get(ATTENTION_MASK).sum(-1).tolist()):
        if row > first and used + length > max_tokens:
            parts.append(batch[first:row])
            first, used = row, 0
        used += length
    parts.append(batch[first:])
    return parts


def _accumulate(
    cfg: GRPORecipeConfig, learner: Learner, scale: Scale, *, fresh: bool, mismatch: list | None
) -> dict[str, float]:
    """The forward and backward passes of one optimizer step's mini-batches; their summed loss and mean diagnostics.
    ``fresh``: no update yet this step; ``mismatch``: where the mini-batches' sampler mismatch counts go (``None``:
    not counted; the counts are sums, so micro-batches add up to their mini-batch's).

    With ``train.max_tokens_per_micro_batch`` each mini-batch runs as token-budget micro-batches, each loss scaled by
    its share of the mini-batch's (``MICRO_BATCH_SHARES``): the gradients add up to the mini-batch's own. Under DDP
    only the last micro-batch's backward all-reduces (processes may cut their mini-batches into different numbers)."""
    values: dict[str, float] = {}
    share_of = MICRO_BATCH_SHARES[cfg.loss.type]
    for _ in range(scale.accumulation):
        # One TensorDict of the step's rows (make_replay_buffer's TensorStorage): contiguous() costs nothing then, and
        # a storage that hands out a lazy stack of samples would be stacked once here, not per sample in the loss.
        mini_batch = learner.buffer.sample().contiguous()
        parts = token_micro_batches(mini_batch, cfg.train.max_tokens_per_micro_batch)
        whole_mask = mini_batch.get(LOSS_MASK)
        for index, part in enumerate(parts):
            share = share_of(part.get(LOSS_MASK), whole_mask) if len(parts) > 1 else 1.0
            tokens_share = (
                float(part.get(LOSS_MASK).sum()) / max(float(whole_mask.sum()), 1.0) if len(parts) > 1 else 1.0
            )
            with learner.forward_context():
                out = learner.loss(part, scale=scale, fresh=fresh)
            counts = out.pop("sampler_mismatch", None)
            if counts is not None and mismatch is not None:
                mismatch.append(counts.detach().float().cpu())
            _stop_unless_finite(out["loss"], "loss")
            with _gradient_sync(learner.loss.scorer, last=index == len(parts) - 1):
                (out["loss"] * share).backward()
            values["train/loss"] = values.get("train/loss", 0.0) + float(out["loss"].detach()) * share
            for name, value in out.items():
                if name == "loss":
                    continue
                weight = share if name == "policy_loss" else tokens_share  # the diagnostics are token means
                values[f"train/{name}"] = values.get(f"train/{name}", 0.0) + float(value) * weight / scale.accumulation
    return values


def _gradient_sync(scorer, *, last: bool):
    """DDP's ``no_sync`` for all but a mini-batch's last backward: the gradients accumulate locally, then all-reduce
    once, so processes that cut their mini-batches into different numbers of micro-batches stay in step."""
    if last or not isinstance(scorer, DistributedDataParallel):
        return contextlib.nullcontext()
    return scorer.no_sync()


def _sync_reference(cfg: GRPORecipeConfig, learner: Learner) -> None:
    """TR-DPO: every ``loss.ref_model_sync_steps`` optimizer steps the reference moves towards the policy,
    ``ref = alpha * policy + (1 - alpha) * ref`` (``loss.ref_model_mixup_alpha``), as trl's ``sync_ref_model``."""
    if learner.synced_reference is None or learner.optimizer_steps_done % cfg.loss.ref_model_sync_steps:
        return
    alpha = cfg.loss.ref_model_mixup_alpha
    with torch.no_grad():
        for reference, current in zip(learner.synced_reference.parameters(), learner.policy.parameters(), strict=True):
            reference.mul_(1 - alpha).add_(current.detach(), alpha=alpha)
