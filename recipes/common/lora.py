"""LoRA adapters through peft, set from a model node's ``lora`` entry (``conf/model/*.yaml``,
``conf/reward_model/*.yaml``).

``lora: null`` trains every weight. ``lora: {r, alpha, dropout, target_modules}`` freezes the base model and trains
low-rank adapters on the named linear layers (``peft.LoraConfig(r, lora_alpha, lora_dropout, target_modules)``).

- :func:`validate_lora_node`: the checks a recipe's ``validate`` runs before anything loads.
- :func:`make_lora_config`: the node as a ``peft.LoraConfig`` of a task type (``CAUSAL_LM``, ``SEQ_CLS``).
- :func:`is_peft_model`: whether a model carries adapters.

GRPO's LoRA policy is loaded by ``recipes.grpo.policy.load_policy``; its KL reference, the policy with its adapters
off, is ``recipes.grpo.log_probs.AdapterDisabledLogProbs``.

Dependencies: torch, omegaconf, and ``peft`` (imported when a model gets adapters).
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, ListConfig

from recipes.common.config import ConfigError

__all__ = ["LORA_KEYS", "is_peft_model", "make_lora_config", "validate_lora_node"]

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
