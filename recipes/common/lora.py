"""LoRA adapters through peft, set from a model node's ``lora`` entry (``conf/model/*.yaml``,
``conf/reward_model/*.yaml``).

``lora: null`` trains every weight. ``lora: {r, alpha, dropout, target_modules}`` freezes the base model and trains
low-rank adapters on the named linear layers (``peft.LoraConfig(r, lora_alpha, lora_dropout, target_modules)``).

- :func:`validate_lora_node`: the checks a recipe's ``validate`` runs before anything loads.
- :func:`make_lora_config`: the node as a ``peft.LoraConfig`` of a task type (``CAUSAL_LM``, ``SEQ_CLS``).
- :func:`load_policy`: the GRPO policy, with fresh adapters or a checkpoint's, or the full model when ``lora`` is null.
- :class:`AdapterDisabledLogProbs`: a LoRA policy's log-probs with its adapters switched off, i.e. the frozen base
  model's: GRPO's KL reference without a second copy of the model in memory.
- :func:`trainable_parameters`: what the optimizer takes.

Dependencies: torch, omegaconf, and ``peft`` (imported when a model gets adapters).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn

from recipes.common.config import ConfigError
from recipes.common.log_probs import CHUNK_ELEMENTS, ResponseLogProbs
from recipes.common.models import load_causal_lm

__all__ = [
    "AdapterDisabledLogProbs",
    "is_peft_model",
    "load_policy",
    "make_lora_config",
    "trainable_parameters",
    "validate_lora_node",
]

LORA_KEYS = ("r", "alpha", "dropout", "target_modules")
_EXAMPLE = "{r:16,alpha:32,dropout:0.0,target_modules:[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]}"


def validate_lora_node(lora, *, key: str) -> None:
    """Refuses a ``lora`` entry that is neither null nor a complete, sensible ``{r, alpha, dropout, target_modules}``.

    Args:
        lora: the entry (``cfg.model.lora``...).

    Keyword Args:
        key: its name in the config, for the message (``"model.lora"``).

    Raises:
        ConfigError: naming the setting and what to write instead.
    """
    if lora is None:
        return
    if not isinstance(lora, (DictConfig, dict)) or set(lora) != set(LORA_KEYS):
        found = sorted(lora) if isinstance(lora, (DictConfig, dict)) else repr(lora)
        raise ConfigError(
            f"{key}={found}: expected null (full fine-tuning) or a mapping of exactly {list(LORA_KEYS)}, e.g. "
            f"'{key}={_EXAMPLE}'."
        )
    if not isinstance(lora.r, int) or isinstance(lora.r, bool) or lora.r < 1:
        raise ConfigError(f"{key}.r={lora.r!r}: the adapters' rank must be an integer >= 1 (8 or 16 are usual).")
    if not isinstance(lora.alpha, (int, float)) or lora.alpha <= 0:
        raise ConfigError(f"{key}.alpha={lora.alpha!r}: the scale (alpha / r multiplies the update) must be > 0.")
    if not isinstance(lora.dropout, (int, float)) or not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"{key}.dropout={lora.dropout!r}: expected a probability in [0, 1).")
    modules = lora.target_modules
    names_ok = isinstance(modules, (ListConfig, list)) and modules and all(isinstance(m, str) for m in modules)
    if not (names_ok or modules == "all-linear"):
        raise ConfigError(
            f"{key}.target_modules={modules!r}: expected a non-empty list of module names (the last part of the "
            "names of the linear layers to adapt, e.g. [q_proj,v_proj] in Qwen or Llama models), or all-linear."
        )


def make_lora_config(lora: DictConfig, *, task_type: str, modules_to_save: Sequence[str] | None = None):
    """A ``peft.LoraConfig`` from a validated ``lora`` node.

    Keyword Args:
        task_type: ``"CAUSAL_LM"`` (a policy) or ``"SEQ_CLS"`` (a reward model).
        modules_to_save: modules trained in full and saved with the adapter (a reward model's new ``score`` head).
    """
    from peft import LoraConfig

    modules = lora.target_modules
    return LoraConfig(
        task_type=task_type,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=float(lora.dropout),
        target_modules=modules if isinstance(modules, str) else list(modules),
        modules_to_save=list(modules_to_save) if modules_to_save else None,
    )


def is_peft_model(model) -> bool:
    """Whether ``model`` carries peft adapters (what switches GRPO's reference to the adapter-disabled policy)."""
    return callable(getattr(model, "disable_adapter", None)) and callable(getattr(model, "get_base_model", None))


def load_policy(node: DictConfig, *, device: str, dtype: str, saved: DictConfig | None = None):
    """The GRPO policy: ``node``'s causal LM, with LoRA adapters when ``node.lora`` is set.

    Args:
        node: the run's model node (``cfg.model``).

    Keyword Args:
        saved: the node of a checkpoint's model folder to resume from; ``None`` starts afresh. Without LoRA that folder
            holds the whole model; with LoRA only the adapter, applied (trainable) to ``node``'s base, which no
            update changes.
    """
    if node.lora is None:
        return load_causal_lm(saved if saved is not None else node, device=device, dtype=dtype)
    from peft import PeftModel, get_peft_model

    base = load_causal_lm(node, device=device, dtype=dtype)
    if saved is None:
        return get_peft_model(base, make_lora_config(node.lora, task_type="CAUSAL_LM"))
    return PeftModel.from_pretrained(base, str(saved.name_or_path), is_trainable=True).to(device)


class AdapterDisabledLogProbs(nn.Module):
    """A LoRA policy's response log-probs with its adapters switched off: the frozen base model's, GRPO's reference.

    The base weights never train under LoRA, so the initial policy need not be loaded a second time.

    Args:
        model: a ``peft.PeftModel`` over a causal LM.

    Keyword Args:
        chunk_elements: passed to :class:`ResponseLogProbs`.
        scorer: the scorer to run with the adapters off instead of a new :class:`ResponseLogProbs`: that of a sharded
            ``model`` (``recipes.common.sharding.ShardedResponseLogProbs``), whose weights only its registered
            forward gathers. The adapters are switched off before it gathers them; peft's switch is a flag on each
            LoRA layer (and ``requires_grad`` on its sharded adapters, which FSDP2 copies to the gathered ones).
    """

    def __init__(self, model, *, chunk_elements: int = CHUNK_ELEMENTS, scorer: nn.Module | None = None) -> None:
        super().__init__()
        if not is_peft_model(model):
            raise TypeError(f"AdapterDisabledLogProbs: expected a peft.PeftModel, got {type(model).__name__}.")
        self.peft_model = model
        self.scorer = scorer if scorer is not None else ResponseLogProbs(model, chunk_elements=chunk_elements)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
        with self.peft_model.disable_adapter():
            return self.scorer(tokens, attention_mask, **kwargs)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters that train (all of them, or a LoRA model's adapters): a list, clipped at every update."""
    return [parameter for parameter in model.parameters() if parameter.requires_grad]
