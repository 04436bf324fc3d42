"""One decoding step of a Llama-family ``transformers`` causal LM, through its own parts without the wrappers around
them.

A decoding step feeds one token per row. On a small model most of its time is Python around the arithmetic: the
causal LM's, the base model's, each decoder layer's, attention's, MLP's and linear layer's ``__call__``, the
decorators (keyword merging, output capture, deprecated names) and the output objects. :class:`DecodeStep` runs the
step the model's ``forward`` runs for one new token per row, op for op and in the same order:

- the embeddings, norms, rotary embedding and output head are called as the model's modules (an adapter, a hook, a
  kernel or a patched class there still runs);
- the attention math is the modeling module's own ``apply_rotary_pos_emb``, ``cache.update`` and the SDPA function
  transformers registers;
- a linear layer is ``F.linear`` over its weights, and an MLP the three products of its class's ``forward``, only where
  the module is exactly ``nn.Linear`` or that class with nothing hooked on it (``nn.Linear.forward`` is that call);
  any other is called.

So the logits and the cache are the model's, bit for bit (``tests/interop/test_decode_step.py``), for less Python:
64 rows of the built-in tiny policy (2 layers) on one thread, a step 1.35-1.40 -> 1.02-1.03 ms, a 32-token sampling
loop 60-65 -> 50-53 ms. A model whose step is its arithmetic (the real-vocabulary speed model's output head) gains
nothing measurable.

It serves the architectures whose forward it was read from (``_ARCHITECTURES``: Llama, Qwen2 and Qwen3 in
transformers 5) with SDPA attention, full-attention layers only and a ``DynamicCache`` of plain layers, when nothing
is hooked on or patched into the wrappers it skips; :meth:`DecodeStep.of` returns ``None`` otherwise, and the sampler
calls the model as before.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# model_type -> (modeling module, causal LM, base model, decoder layer, attention, MLP class names, whether the
# attention normalizes queries and keys per head: Qwen3's q_norm / k_norm). Read in transformers 5's
# modeling_{llama,qwen2,qwen3}.py: the same decoder layer, attention and MLP forward, but for those two norms.
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", False),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", "Qwen2Model", "Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "Qwen3Model", "Qwen3DecoderLayer", "Qwen3Attention", "Qwen3MLP", True),
}

_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _is_plain(module: nn.Module) -> bool:
    """Whether calling ``module`` runs its class's ``forward`` and nothing else: no hook on it, no ``forward`` of its
    own instance (but trl's pass-through, :func:`_is_trl_fused_forward`), and no gradient checkpointing in training (a
    checkpointing decoder layer drops the cache)."""
    return (
        not module._forward_hooks
        and not module._forward_pre_hooks
        and not module._backward_hooks
        and not module._backward_pre_hooks
        and ("forward" not in vars(module) or _is_trl_fused_forward(module))
        and not (getattr(module, "gradient_checkpointing", False) and module.training)
    )


def _is_trl_fused_forward(module: nn.Module) -> bool:
    """Whether ``module``'s own ``forward`` is the one ``trl``'s ``GRPOTrainer`` sets on its model
    (``trl.trainer.utils.add_fused_lm_head``) directly over the class's forward: without ``fused_lm_head=True``, which
    sampling never passes, it calls that forward with the same arguments."""
    forward = vars(module)["forward"]
    function: Any = getattr(forward, "__func__", None)
    code = getattr(function, "__code__", None)
    if (
        getattr(forward, "__self__", None) is not module
        or code is None
        or code.co_name != "_fused_forward"
        or function.__globals__.get("__name__") != "trl.trainer.utils"
        or "original_forward" not in code.co_freevars
    ):
        return False
    wrapped = function.__closure__[code.co_freevars.index("original_forward")].cell_contents
    return getattr(wrapped, "__func__", None) is type(module).forward and getattr(wrapped, "__self__", None) is module


def _is_plain_instance(module: nn.Module, cls: type) -> bool:
    """An instance of exactly ``cls`` (not of a subclass, whose forward may differ), and :func:`_is_plain`."""
    return type(module) is cls and _is_plain(module)


def _linear(module: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s product: ``F.linear`` over its weights where it is a plain ``nn.Linear`` (what its ``forward``
    calls), else the module itself (an adapter's layer, a quantized one, a hooked one)."""
    if _is_plain_instance(module, nn.Linear):
        return lambda x: F.linear(x, module.weight, module.bias)
    return module


def _mlp(module: Any, mlp_class: type | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward (``down(act(gate(x)) * up(x))``) with its products through :func:`_linear`, where it is
    a plain ``mlp_class`` (transformers' own); else the module itself (a patched MLP class runs as it is)."""
    if mlp_class is None or not _is_plain_instance(module, mlp_class):
        return module
    gate, up, down = _linear(module.gate_proj), _linear(module.up_proj), _linear(module.down_proj)
    act = module.act_fn
    return lambda x: down(act(gate(x)) * up(x))


class DecodeStep:
    """A decoding step of ``model`` that skips its wrappers (see the module's docstring); build it with :meth:`of`.

    Called with the rows' new tokens (``[rows, 1]``), the mask its SDPA attention reads (the 4D bool
    ``[rows, 1, 1, columns]`` the sampler prepares, or ``None`` when no row has padding), each row's position
    (``[rows, 1]``) and the KV cache, it appends the new keys and values to the cache and returns the next logits
    (``[rows, V]``), as ``model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache,
    use_cache=True).logits[:, -1]`` would.
    """

    def __init__(self, model: Any, layers: list, modeling, mlp_class: type | None, normalizes_queries: bool) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.model = model
        self.attention = ALL_ATTENTION_FUNCTIONS["sdpa"]
        self.apply_rotary_pos_emb = modeling.apply_rotary_pos_emb  # the one the attention's forward calls
        self.normalizes_queries = normalizes_queries
        self.layers = [
            (
                layer,
                _linear(layer.self_attn.q_proj),
                _linear(layer.self_attn.k_proj),
                _linear(layer.self_attn.v_proj),
                _linear(layer.self_attn.o_proj),
                _mlp(layer.mlp, mlp_class),
            )
            for layer in layers
        ]

    @classmethod
    def of(cls, model: Any, cache: Any) -> DecodeStep | None:
        """The step for ``model`` decoding into ``cache``, or ``None`` where skipping the wrappers could change what
        runs: another architecture (or a wrapped model: PEFT, DDP, FSDP2), another attention implementation, a
        sliding-window layer, a cache other than a ``DynamicCache`` of plain layers, a hook on a wrapper or on every
        module."""
        architecture = _ARCHITECTURES.get(str(getattr(getattr(model, "config", None), "model_type", None)))
        if architecture is None:
            return None
        module_name, *class_names, normalizes_queries = architecture
        try:
            modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
            from transformers.cache_utils import DynamicCache, DynamicLayer
        except ImportError:
            return None
        lm_class, base_class, layer_class, attention_class, mlp_class = (getattr(modeling, n) for n in class_names)
        config = model.config
        base: Any = getattr(model, "model", None)
        if (
            type(model) is not lm_class
            or type(base) is not base_class
            or getattr(config, "_attn_implementation", None) != "sdpa"
            or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())
            or getattr(config, "use_sliding_window", False)
            or type(cache) is not DynamicCache
            or any(type(layer) is not DynamicLayer for layer in cache.layers)
            or any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS)
        ):
            return None
        layers = list(base.layers[: base.config.num_hidden_layers])  # the layers the base model's forward runs
        if (
            any(type(layer) is not layer_class or type(layer.self_attn) is not attention_class for layer in layers)
            or not all(_is_plain(module) for module in (model, base, *layers, *(layer.self_attn for layer in layers)))
            # A class the modeling module was patched with (its name now bound to another module's class) has a
            # forward of its own.
            or any(inspect.getmodule(c) is not modeling for c in (lm_class, base_class, layer_class, attention_class))
        ):
            return None
        own_mlp = mlp_class if inspect.getmodule(mlp_class) is modeling else None
        return cls(model, layers, modeling, own_mlp, normalizes_queries)

    def __call__(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor, cache
    ) -> torch.Tensor:
        base = self.model.model
        hidden = base.embed_tokens(tokens)
        cos, sin = base.rotary_emb(hidden, positions)
        input_shape = hidden.shape[:-1]
        for layer, q_proj, k_proj, v_proj, o_proj, mlp in self.layers:
            # The decoder layer's forward, its attention's inlined.
            attn = layer.self_attn
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            shape = (*input_shape, -1, attn.head_dim)
            queries, keys = q_proj(hidden).view(shape), k_proj(hidden).view(shape)
            if self.normalizes_queries:
                queries, keys = attn.q_norm(queries), attn.k_norm(keys)
            values = v_proj(hidden).view(shape).transpose(1, 2)
            queries, keys = self.apply_rotary_pos_emb(queries.transpose(1, 2), keys.transpose(1, 2), cos, sin)
            keys, values = cache.update(keys, values, attn.layer_idx)
            out, _ = self.attention(
                attn,
                queries,
                keys,
                values,
                attention_mask,
                dropout=attn.attention_dropout if attn.training else 0.0,
                scaling=attn.scaling,
            )
            hidden = residual + o_proj(out.reshape(*input_shape, -1).contiguous())
            hidden = hidden + mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(base.norm(hidden))[:, -1]
