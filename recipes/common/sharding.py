"""FSDP2 sharding of a causal LM and its frozen companions (GRPO's ``distributed.strategy=fsdp`` under ``torchrun``,
and the reward recipe's save under accelerate's FSDP2): each process
holds 1/N of their parameters (and of the policy's gradients and optimizer state), and gathers a layer's full weights
only while that layer runs.

- :func:`shard_policy`: ``torch.distributed.fsdp.fully_shard`` on every decoder layer, then on the whole causal LM
  (the root, holding the embeddings, the final norm and the LM head), in place. A LoRA policy (``peft.PeftModel``)
  is sharded the same way, its adapters inside the layers they adapt: a unit then holds frozen base weights and
  trainable adapters, which FSDP2 allows (only the adapters get gradients, reduce-scattered).
- :func:`is_sharded`: whether a model is FSDP2-sharded.
- :func:`gather_full_state`: the full model and optimizer state dicts, gathered onto rank 0's CPU, for a checkpoint
  that loads with ``from_pretrained`` and resumes under any number of processes; :func:`gather_full_model_state`, the
  model's alone (the reward recipe's model, sharded by accelerate's FSDP2).
- :func:`load_full_optimizer_state`: such a gathered optimizer state put back into a sharded optimizer.

- :func:`shard_frozen_model`: the frozen reference and the reward model sharded the same way (1/N of their weights
  per process), every unit resharded after each forward since no backward follows. A LoRA policy has no separate
  reference: it is the sharded policy itself, scored with its adapters switched off.

The GRPO policy's log-probs through a sharded model: ``recipes.grpo.log_probs.ShardedResponseLogProbs``.

Dependencies: torch (``torch.distributed.fsdp``, ``torch.distributed.checkpoint``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = [
    "decoder_layers",
    "gather_full_model_state",
    "gather_full_state",
    "is_sharded",
    "load_full_optimizer_state",
    "shard_policy",
    "shard_frozen_model",
]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by ``fully_shard`` (its parameters are DTensor shards)."""
    return isinstance(model, FSDPModule)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM (or of a peft model's base), one FSDP2 unit each."""
    # A peft model's decoder layers (its LoRA layers within them) are its transformers base model's.
    if callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    # transformers names the blocks it never splits across devices: the decoder layers of any architecture.
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"shard_policy: found no decoder layers in {type(model).__name__} (it names none in _no_split_modules); "
            "use distributed.strategy=ddp for this model."
        )
    return layers


def shard_policy(model: nn.Module) -> nn.Module:
    """Shards ``model`` in place over the default process group: one ``fully_shard`` per decoder layer (its weights
    are gathered only while it runs forward or backward), one on the model for what is left (embeddings, final norm,
    LM head, tied or not), after every rank took rank 0's weights. Build the optimizer afterwards, over the sharded
    parameters. Returns ``model``.

    ``model`` may be a ``peft.PeftModel``: the root is then the PeftModel itself (what the recipe calls, saves and
    switches the adapters of), its decoder layers those of the base model."""
    _copy_rank0_weights(model)
    _shard_per_layer(model)
    return model


def shard_frozen_model(model: nn.Module) -> nn.Module:
    """Shards a frozen model (the KL reference, the reward model) in place as :func:`shard_policy` shards the policy,
    one unit per decoder layer and the root, except that every unit, the root included, gives its gathered weights
    back after each forward: no backward follows to reuse them (FSDP2 keeps the root's gathered for one by default).
    Every process read the same weights, so none are copied from rank 0. Every process must run each of its forward
    passes (the reference through :class:`ShardedResponseLogProbs`; a reward model through its own ``forward``, the
    same number of micro-batches on every process). Returns ``model``."""
    _shard_per_layer(model, reshard_after_forward=True)
    return model


def _shard_per_layer(model: nn.Module, **options) -> None:
    # Inner units first: the root's fully_shard then takes only what no decoder layer holds.
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)


@torch.no_grad()
def _copy_rank0_weights(model: nn.Module) -> None:
    # Every rank keeps only its own slice of each tensor, so the ranks must agree on the whole before sharding, as
    # DistributedDataParallel makes them (it starts every rank from rank 0's weights). Weights read from one folder do;
    # fresh LoRA adapters are drawn from each rank's own RNG and would otherwise be stitched from different draws.
    for tensor in [*model.parameters(), *model.buffers()]:
        torch.distributed.broadcast(tensor.data, src=0)


_FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


def gather_full_model_state(model: nn.Module) -> dict:
    """The full (unsharded) state dict of a sharded ``model``, on CPU, for ``save_pretrained(state_dict=...)``. Every
    rank must call it (the shards are all-gathered); rank 0 gets the tensors, the other ranks an empty dict
    (``cpu_offload`` keeps a single copy, rank 0's)."""
    return get_model_state_dict(model, options=_FULL_ON_CPU)


def gather_full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """:func:`gather_full_model_state` and the full state dict of ``model``'s ``optimizer``, keyed by parameter names,
    gathered the same way (every rank calls it, rank 0 gets the tensors)."""
    return gather_full_model_state(model), get_optimizer_state_dict(model, optimizer, options=_FULL_ON_CPU)


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Loads an optimizer state gathered by :func:`gather_full_state` into the optimizer of a sharded ``model``: each
    rank keeps its own shard of every moment. Every rank must call it with the whole state (each reads the
    checkpoint), whatever the number of processes that saved it."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
