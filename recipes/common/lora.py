"""LoRA adapters through peft, set from a model node's ``lora`` entry (``conf/model/*.yaml``,
``conf/reward_model/*.yaml``).

``lora: null`` or ``lora.enabled: false`` trains every weight. ``lora: {enabled: true, r, alpha, dropout,
target_modules}`` freezes the base model and trains low-rank adapters on the named linear layers
(``peft.LoraConfig(r, lora_alpha, lora_dropout, target_modules)``). The shipped model nodes hold the whole node, off,
with its documented defaults, so that a command line turns it on the way users type it: ``model.lora.r=8``,
``model.lora.enabled=true`` or ``model.lora={r:16,...}`` (:func:`settle_lora_node`).

- :func:`settle_lora_node`: a model node's ``lora`` entry as the run trains it: null (off), or on.
- :func:`validate_lora_node`: the checks of a ``lora`` node no recipe schema checked (``schema.LoraNode``'s).
- :func:`make_lora_config`: the node as a ``peft.LoraConfig`` of a task type (``CAUSAL_LM``, ``SEQ_CLS``).
- :func:`is_peft_model`: whether a model carries adapters.

GRPO's LoRA policy is loaded by ``recipes.grpo.policy.load_policy``; its KL reference, the policy with its adapters
off, is ``recipes.grpo.log_probs.AdapterDisabledLogProbs``.

Dependencies: torch, omegaconf, and ``peft`` (imported when a model gets adapters).
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from recipes.common.config import ConfigError

__all__ = [
    "LORA_KEYS",
    "check_lora_targets",
    "is_peft_model",
    "make_lora_config",
    "settle_lora_node",
    "validate_lora_node",
    "validate_policy_lora",
]

LORA_KEYS = ("r", "alpha", "dropout", "target_modules")
_EXAMPLE = "{r:16,alpha:32,dropout:0.0,target_modules:[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]}"


def settle_lora_node(cfg: DictConfig, key: str, command_line: dict[str, str]) -> None:
    """Sets ``cfg.<key>.lora`` to what the run trains with, in place: ``None`` (full fine-tuning) or the node with
    ``enabled: true``.

    LoRA is on when ``<key>.lora.enabled`` is true, or when the command line (``command_line``: the keys it set,
    ``recipes.common.config.command_line_keys``) sets ``<key>.lora`` or any key under it without also setting
    ``<key>.lora.enabled=false``: ``model.lora.r=8`` turns LoRA on with the node's other settings.
    """
    node = OmegaConf.select(cfg, f"{key}.lora")
    if node is None:
        return
    prefix = f"{key}.lora"
    touched = any(name == prefix or name.startswith(f"{prefix}.") for name in command_line)
    enabled = bool(node.get("enabled", True))
    if f"{prefix}.enabled" not in command_line:
        enabled = enabled or touched
    if enabled:
        node.enabled = True
    else:
        OmegaConf.update(cfg, prefix, None, merge=False)


def validate_lora_node(lora, *, key: str) -> None:
    """Refuses a ``lora`` entry that is neither null nor a complete, sensible ``{r, alpha, dropout, target_modules}``:
    a node a recipe's schema did not check (its ranges and rules are ``recipes.common.schema.LoraNode``'s).

    Args:
        lora: the entry (``cfg.model.lora``...).

    Keyword Args:
        key: its name in the config, for the message (``"model.lora"``).

    Raises:
        ConfigError: naming the setting and what to write instead.
    """
    from recipes.common.schema import LoraNode, typed_config  # the schema settles LoRA nodes with this module

    if lora is None:
        return
    if not isinstance(lora, (DictConfig, dict)) or set(lora) - {"enabled"} != set(LORA_KEYS):
        found = sorted(lora) if isinstance(lora, (DictConfig, dict)) else repr(lora)
        raise ConfigError(
            f"{key}={found}: expected null (full fine-tuning) or a mapping of exactly {list(LORA_KEYS)} (and "
            f"enabled), e.g. '{key}={_EXAMPLE}'."
        )
    values = OmegaConf.to_container(lora, resolve=True) if isinstance(lora, DictConfig) else dict(lora)
    typed_config({"enabled": True, **values}, LoraNode, key=key)


def validate_policy_lora(model: DictConfig, reward_model: DictConfig | None) -> None:
    """The LoRA checks of a recipe that trains a policy (``model``) against a frozen reward model (``reward_model``),
    beyond its schema's: ``model.lora``'s target modules exist in the policy (read on the meta device: nothing loads),
    and no ``reward_model.lora``, which would train nothing. The nodes as DictConfigs
    (``recipes.common.models`` merges an adapter's node with its base's)."""
    from recipes.common.models import meta_model  # models imports the checkpoint helpers; only when checking

    if model.lora is not None:
        check_lora_targets(model.lora, meta_model(model, kind="policy"), key="model.lora")
    if reward_model is not None and reward_model.lora is not None:
        raise ConfigError(
            "reward_model.lora is set, but the reward model is frozen here: it trains no adapters. Drop it (to score "
            "with a LoRA reward model, point reward_model.name_or_path at the adapter folder the reward recipe saved)."
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


def check_lora_targets(lora: DictConfig, model, *, key: str) -> None:
    """Refuses ``target_modules`` names that match no linear layer of ``model`` (a meta-device model does: nothing
    loads), as peft would only after loading the weights. A name matches a layer whose dotted name is it or ends in
    ``.<name>``, as peft matches a list; a single string other than ``all-linear`` is peft's regular expression."""
    import re

    from torch import nn

    targets = lora.target_modules
    if targets == "all-linear":
        return
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if isinstance(targets, str):
        unmatched = [] if any(re.fullmatch(targets, name) for name in linear) else [targets]
    else:
        unmatched = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in linear)]
    if unmatched:
        layer_names = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise ConfigError(
            f"{key}.target_modules: {unmatched} match no linear layer of the model, so no adapter would go there (peft "
            f"refuses it only after loading the weights). Its linear layers are named {layer_names}; pick among "
            f"them, or {key}.target_modules=all-linear."
        )
