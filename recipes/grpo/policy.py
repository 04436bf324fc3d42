"""The policy GRPO trains: loaded whole or with LoRA adapters, what the optimizer updates, and the memory switches of
its update (activation checkpointing, bf16 autocast over fp32 weights).

- :func:`load_policy`: the causal LM of the ``model=`` node, with fresh adapters or a checkpoint's when ``lora`` is
  set (``recipes.common.lora``), or the whole model.
- :func:`trainable_parameters`: what the optimizer takes (all parameters, or the adapters).
- :func:`enable_activation_checkpointing`: turns on Hugging Face's checkpointing of the decoder layers
  (non-reentrant ``torch.utils.checkpoint``).
- :func:`update_forward`: the context a loss forward runs in: bf16 autocast when asked, and the decoder layers
  marked as training so that their checkpointing applies while the policy stays in ``eval()``.

Why the second is needed: transformers 5 checkpoints a ``GradientCheckpointingLayer`` only when the layer is in
training mode. The GRPO recipe keeps its policy in ``eval()`` (importance ratios must not differ by dropout, and
generation keeps its KV cache), so checkpointing, once enabled, would never run. Marking only the decoder layers
themselves (not their attention and MLP children, which hold the dropout) as training makes the checkpointing apply
and leaves every dropout off, whatever the model's dropout settings.

Dependencies: torch, omegaconf, transformers, and ``peft`` (imported when the policy gets adapters).
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Iterator

import torch
from torch import nn

from recipes.common.lora import make_lora_config
from recipes.common.models import load_causal_lm
from recipes.common.schema import ModelNode, config_view
from recipes.grpo.schema import MixedPrecision

__all__ = [
    "MIXED_PRECISIONS",
    "checkpointed_layers",
    "enable_activation_checkpointing",
    "load_policy",
    "trainable_parameters",
    "update_forward",
]

# train.mixed_precision's choices: "no" (the loss forward in the weights' dtype) or "bf16" (bf16 autocast).
MIXED_PRECISIONS = typing.get_args(MixedPrecision)


def load_policy(node: ModelNode, *, device: str, dtype: str, saved: ModelNode | None = None):
    """The GRPO policy: ``node``'s causal LM, with LoRA adapters when ``node.lora`` is set.

    Args:
        node: the run's model node (``cfg.model``).

    Keyword Args:
        saved: the node of a checkpoint's model folder to resume from; ``None`` starts afresh. Without LoRA that folder
            holds the whole model; with LoRA only the adapter, applied (trainable) to ``node``'s base, which no
            update changes.
    """
    # recipes.common.models merges a model node with OmegaConf (an adapter's base): it reads a DictConfig view.
    if node.lora is None:
        return load_causal_lm(config_view(saved if saved is not None else node), device=device, dtype=dtype)
    from peft import PeftModel, get_peft_model

    base = load_causal_lm(config_view(node), device=device, dtype=dtype)
    if saved is None:
        return get_peft_model(base, make_lora_config(node.lora, task_type="CAUSAL_LM"))
    return PeftModel.from_pretrained(base, str(saved.name_or_path), is_trainable=True).to(device)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters that train (all of them, or a LoRA model's adapters): a list, clipped at every update."""
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose forward Hugging Face checkpoints when checkpointing is on."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Checkpoints every decoder layer of a ``transformers`` model: the backward recomputes each layer's activations
    instead of keeping them. Non-reentrant, the variant that works with DDP and with inputs that need no grad."""
    if not checkpointed_layers(model):
        raise ValueError(
            f"enable_activation_checkpointing: {type(model).__name__} has no transformers GradientCheckpointingLayer "
            "to checkpoint; set train.gradient_checkpointing=false for this model."
        )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def update_forward(model: nn.Module, *, mixed_precision: str, device: str | torch.device) -> Iterator[None]:
    """The context of a loss forward pass over ``model`` (run the backward after it, outside).

    Keyword Args:
        mixed_precision: ``"no"``, or ``"bf16"``: matmuls in bfloat16 under ``torch.autocast`` while the weights, their
            gradients and the optimizer stay in the weights' dtype (float32). The checkpointed layers' recomputation
            in the backward reruns under the same autocast state (``torch.utils.checkpoint`` records it).
        device: where the model runs (its type picks the autocast backend; CPU autocast supports bfloat16).
    """
    if mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"update_forward: mixed_precision={mixed_precision!r}; expected one of {MIXED_PRECISIONS}.")
    # Only the layers themselves: their children (attention, MLP, dropout) stay in eval mode.
    layers = [layer for layer in checkpointed_layers(model) if layer.gradient_checkpointing and not layer.training]
    for layer in layers:
        layer.training = True
    try:
        with torch.autocast(
            device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16"
        ):
            yield
    finally:
        for layer in layers:
            layer.training = False
