"""The learner's side of a GRPO step: complete the batch, update the policy over mini-batches.

- :class:`Learner` and :func:`make_learner`: the batch preparation, replay buffer, loss, optimizer, the parameters it
  clips and the context of each loss forward, built from the config and the loaded models.
- :class:`PrepareBatch`: group advantages (``MCAdvantage``), then the reference's (and, where a batch lacks them and
  a step makes several updates, the old policy's) log-probs over the response positions.
- :func:`optimize`: ``train.epochs_per_step`` passes over the step's responses in mini-batches.

Dependencies: torch, tensordict, torchrl, hydra.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from tensordict import TensorDictBase
from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement

from recipes.common.config import RunStopped
from recipes.common.sharding import is_sharded, shard_frozen_model
from recipes.grpo.batch import LOG_PROBS, PROMPT_INDEX, REF_LOG_PROBS
from recipes.grpo.log_probs import ResponseLogProbs, ScoreLogProbs, make_policy_scorer, make_reference_scorer
from recipes.grpo.loss import GroupAdvantage, ResponseGRPOLoss, make_loss, training_loss
from recipes.grpo.policy import enable_activation_checkpointing, trainable_parameters, update_forward

__all__ = ["Learner", "PrepareBatch", "check_weights_finite", "make_learner", "make_replay_buffer", "optimize"]


class PrepareBatch:
    """The learner's side of a step: group advantages, then the log-probs a batch still needs, in place.

    Args:
        group_size: responses per prompt (each batch holds whole groups).

    Keyword Args:
        reference: a ``ResponseLogProbs`` over the frozen reference model, or ``None`` (no KL term).
        policy: a ``ResponseLogProbs`` over the policy, to score the old log-probs of batches whose collector records
            none usable (TorchRL's ``TransformersWrapper``) when a step makes several updates; ``None``: the batch
            carries them, or is trained on-policy (the loss takes its own log-probs).
        micro_batch_size: sequences per scoring forward pass; ``None``: all at once.
    """

    def __init__(
        self,
        group_size: int,
        *,
        reference: ResponseLogProbs | None,
        policy: ResponseLogProbs | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        self.advantage = GroupAdvantage(group_size, prompt_key=PROMPT_INDEX)
        self.reference = None
        if reference is not None:
            self.reference = ScoreLogProbs(reference, out_key=REF_LOG_PROBS, micro_batch_size=micro_batch_size)
        self.policy = ScoreLogProbs(policy, out_key=LOG_PROBS, micro_batch_size=micro_batch_size) if policy else None

    def __call__(self, batch: TensorDictBase) -> dict[str, float]:
        """Completes ``batch`` in place; returns how long it took (``advantage_s``, ``log_probs_s``)."""
        start = time.perf_counter()
        self.advantage(batch)
        scored = time.perf_counter()
        if self.reference is not None:
            self.reference(batch)
        if self.policy is not None:
            self.policy(batch)
        return {"advantage_s": scored - start, "log_probs_s": time.perf_counter() - scored}


@dataclass
class Learner:
    """What updates the policy: the batch preparation (advantages, reference log-probs), the replay buffer, the loss
    (over the policy's log-prob scorer, DDP-wrapped under a launcher), the optimizer and the parameters it clips, and
    the context of each loss forward (``train.mixed_precision``, ``train.gradient_checkpointing``)."""

    prepare: PrepareBatch
    buffer: Any
    loss: ResponseGRPOLoss
    optimizer: torch.optim.Optimizer
    parameters: list
    forward_context: Any = contextlib.nullcontext


def make_learner(cfg: DictConfig, models) -> Learner:
    """The :class:`Learner` of ``models`` (the policy, and the frozen reference and reward model, if loaded here).

    The policy's log-probs over the response positions go through DDP or FSDP2 (which shards the policy here, before
    the optimizer sees its parameters), so that the loss's backward averages the gradients over the ranks;
    checkpointing is set on the layers first. Under FSDP2 the frozen reference and reward model are sharded too, 1/N
    of each per process (every process scores as many micro-batches as the others, so their gathers match)."""
    if cfg.train.gradient_checkpointing:
        enable_activation_checkpointing(models.policy)
    scorer = make_policy_scorer(models.policy, strategy=cfg.distributed.strategy, device=cfg.device)
    if is_sharded(models.policy):
        for frozen in (models.reference, models.reward_model):
            if frozen is not None:
                shard_frozen_model(frozen)
    parameters = trainable_parameters(models.policy)  # all, or LoRA's adapters; a list: clipped at every update
    return Learner(
        prepare=make_batch_preparation(cfg, models, scorer),
        buffer=make_replay_buffer(cfg),
        loss=make_loss(cfg, scorer),
        optimizer=instantiate(cfg.optimizer)(parameters),
        parameters=parameters,
        forward_context=functools.partial(
            update_forward, models.policy, mixed_precision=cfg.train.mixed_precision, device=cfg.device
        ),
    )


def make_replay_buffer(cfg: DictConfig) -> ReplayBuffer:
    """One step's responses (with their advantages), handed out in mini-batches without replacement."""
    return ReplayBuffer(
        storage=LazyStackStorage(cfg.rollout.responses_per_step),
        sampler=SamplerWithoutReplacement(),
        batch_size=cfg.train.mini_batch_size,
    )


def is_on_policy(cfg: DictConfig) -> bool:
    """One update per step: the responses train the very policy that sampled them, old log-probs = current ones."""
    return cfg.train.epochs_per_step == 1 and cfg.train.mini_batch_size == cfg.rollout.responses_per_step


def make_batch_preparation(cfg: DictConfig, models, scorer) -> PrepareBatch:
    """Advantages and reference log-probs; the old log-probs too where the collector records none (``chat``) and a
    step makes several updates. On-policy, the loss takes its own (as trl does with one update per batch)."""
    scores_old = cfg.rollout.env == "chat" and not is_on_policy(cfg)
    reference = None
    if cfg.loss.kl_to_ref_coeff:
        reference = make_reference_scorer(models.reference, policy=models.policy, policy_scorer=scorer)
    return PrepareBatch(
        cfg.rollout.group_size,
        reference=reference,
        policy=scorer if scores_old else None,
        micro_batch_size=cfg.rollout.log_prob_micro_batch_size,
    )


def optimize(
    cfg: DictConfig, loss_module, optimizer, buffer, parameters: list, *, forward_context=contextlib.nullcontext
) -> dict[str, float]:
    """``train.epochs_per_step`` passes over the buffer in mini-batches; returns the updates' mean diagnostics.

    Each loss forward runs in ``forward_context()`` (bf16 autocast, checkpointed layers: ``Learner.forward_context``),
    its backward outside it."""
    sums: dict[str, float] = {}
    updates = 0
    for _ in range(cfg.train.epochs_per_step):
        for _ in range(cfg.rollout.responses_per_step // cfg.train.mini_batch_size):
            # LazyStackStorage hands out a lazy stack of samples: stacked once here, the loss's logits are not split
            # into per-sample tensors and re-stacked (whose backward copies the whole gradient once per sample).
            with forward_context():
                out = loss_module(buffer.sample().contiguous())
                loss = training_loss(out, entropy_coeff=cfg.loss.entropy_coeff)
            _stop_unless_finite(loss, "loss", cfg)
            loss.backward()
            # null or 0: no clipping (trl's meaning of 0), but the norm is still measured (train/grad_norm).
            max_norm = cfg.train.max_grad_norm or math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
            _stop_unless_finite(grad_norm, "gradient norm", cfg)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            updates += 1
            values = {"train/loss": loss, "train/clip_fraction": out.clip_fraction, "train/entropy": out.entropy}
            if out.kl_to_ref is not None:
                values["train/kl_to_ref"] = out.kl_to_ref
            values["train/grad_norm"] = grad_norm
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + float(value.detach().mean())
    return {key: total / updates for key, total in sums.items()}


# The settings that drive each value, named when it stops being finite.
_DRIVERS = {
    "loss": "the rewards (their sources), loss.clip_epsilon, loss.kl_to_ref_coeff and optimizer.lr",
    "gradient norm": "optimizer.lr and train.max_grad_norm (the loss was finite)",
    "weights": "optimizer.lr (and train.max_grad_norm)",
}


def _stop_unless_finite(value: torch.Tensor, what: str, cfg: DictConfig) -> None:
    if not bool(torch.isfinite(value.detach()).all()):
        raise RunStopped(
            f"The policy's {what} is {float(value.detach().float().flatten()[0])}: training on would save garbage, so "
            f"the run stops here (no checkpoint is written after it). What drives it: {_DRIVERS[what]}. Lower "
            "optimizer.lr, or check the reward sources, then start again or resume=true from the last checkpoint."
        )


def check_weights_finite(parameters: list, cfg: DictConfig) -> None:
    """Stops the run (before a checkpoint is written) if a trainable weight is no longer finite."""
    with torch.no_grad():
        norms = torch._foreach_norm([p.detach() for p in parameters])
    _stop_unless_finite(torch.stack(norms).float().sum(), "weights", cfg)
