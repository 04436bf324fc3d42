"""Loading policies, reward models and tokenizers from a config node, the same way for the tiny kit and hub ids.

A model node (``conf/model/*.yaml``, ``conf/reward_model/*.yaml``) has ``name_or_path`` (a local folder or hub id),
``tokenizer_name_or_path`` (null: the model's own) and ``trust_remote_code`` (off unless the config turns it on).
Weights load as safetensors only.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from recipes.common.config import ConfigError, check_local_path

__all__ = ["load_causal_lm", "load_reward_model", "load_tokenizer", "resolve_dtype", "validate_model_node"]


def validate_model_node(node: DictConfig, *, key: str) -> None:
    """Checks a model node before anything loads: local folders must exist."""
    check_local_path(str(node.name_or_path), key=f"{key}.name_or_path", what="model")
    if node.tokenizer_name_or_path is not None:
        check_local_path(str(node.tokenizer_name_or_path), key=f"{key}.tokenizer_name_or_path", what="tokenizer")


def resolve_dtype(name: str) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` -> the torch dtype, with an error listing the accepted names."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ConfigError(f"dtype={name!r} is not supported; use one of {sorted(dtypes)}.")
    return dtypes[name]


def load_tokenizer(node: DictConfig, *, padding_side: str):
    """The node's tokenizer, with a pad token distinct from EOS (TorchRL's response masks need it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        node.tokenizer_name_or_path or node.name_or_path, trust_remote_code=node.trust_remote_code
    )
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ConfigError(
            f"The tokenizer of {node.name_or_path!r} has no pad token distinct from EOS (pad={tokenizer.pad_token!r}, "
            f"eos={tokenizer.eos_token!r}); with pad == EOS the generated EOS is masked out as padding. Use a "
            "tokenizer with its own pad token (e.g. Qwen's <|endoftext|> when EOS is <|im_end|>)."
        )
    return tokenizer


def load_causal_lm(node: DictConfig, *, device: str, dtype: str):
    """A causal LM from ``node.name_or_path`` on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        node.name_or_path,
        dtype=resolve_dtype(dtype),
        trust_remote_code=node.trust_remote_code,
        use_safetensors=True,
    )
    return model.to(device)


def load_reward_model(node: DictConfig, *, device: str, dtype: str, pad_token_id: int | None = None):
    """A sequence-classification reward model (num_labels=1) whose config knows its tokenizer's pad id.

    HF classification heads score the rightmost token that is not ``config.pad_token_id``, so the id must match the
    tokenizer's pad token; a model saved without it gets it from ``pad_token_id``.
    """
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        node.name_or_path,
        num_labels=1,
        dtype=resolve_dtype(dtype),
        trust_remote_code=node.trust_remote_code,
        use_safetensors=True,
    )
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model.to(device)
