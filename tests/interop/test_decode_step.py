"""``interop.sampling.decode_step.DecodeStep``: a decoding step without the model's wrappers gives the model's logits
and KV cache bit for bit, for each architecture it serves; it is refused wherever skipping a wrapper could change
what runs; and the sampler's draws are the same with it as with the model's forward."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import interop.sampling.sampler as sampler_module
from interop.sampling import SamplingSettings, sample_responses
from interop.sampling.decode_step import DecodeStep

SMALL = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _model(kind: str, **config):
    """A small random model of each architecture the step serves, each with what sets it apart: Llama with biases
    everywhere and a head size that is not hidden / heads, Qwen2 (biased q/k/v), Qwen3 (per-head q/k norms)."""
    torch.manual_seed(0)
    options = {**SMALL, "attn_implementation": "sdpa", **config}
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{"attention_bias": True, "mlp_bias": True, "head_dim": 16, **options}))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**options))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 8, **options}))
    return model.eval()


def _cache_argument(model) -> str:
    return sampler_module._forward_options(model)[1]  # "cache", or "past_key_values" in older transformers 5


def _prefilled(model, padded: bool):
    """Five rows of six-token prompts (two left-padded when ``padded``) run through ``model`` twice, into two caches."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, SMALL["vocab_size"], (5, 6), generator=generator)
    mask = torch.ones_like(tokens)
    if padded:
        mask[0, :2] = 0
        mask[3, :1] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    caches, logits = [], None
    for _ in range(2):
        cache = DynamicCache(config=model.config)
        out = model(input_ids=tokens, attention_mask=mask, position_ids=positions, **{_cache_argument(model): cache})
        caches.append(cache)
        logits = out.logits[:, -1]
    return caches, logits, mask, positions[:, -1:] + 1


def _decode_both_ways(model, padded: bool, steps: int = 4):
    """``steps`` greedy decoding steps through the model's forward and through its :class:`DecodeStep`, from the same
    prefill: the two logits and caches of every step."""
    with torch.inference_mode():
        (model_cache, step_cache), logits, mask, positions = _prefilled(model, padded)
        step = DecodeStep.of(model, step_cache)
        assert step is not None
        token, seen = logits.argmax(-1, keepdim=True), []
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            prepared = mask.bool()[:, None, None, :] if padded else None  # what the sampler hands its steps
            expected = model(
                input_ids=token,
                attention_mask=prepared if padded else mask,
                position_ids=positions,
                **{_cache_argument(model): model_cache},
            ).logits[:, -1]
            got = step(token, prepared, positions, step_cache)
            seen.append((expected, got, model_cache, step_cache))
            token, positions = expected.argmax(-1, keepdim=True), positions + 1
    return seen


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "left_padded"])
def test_the_step_gives_the_model_s_logits_and_cache_bit_for_bit(kind, padded):
    for expected, got, model_cache, step_cache in _decode_both_ways(_model(kind), padded):
        assert got.shape == expected.shape == (5, SMALL["vocab_size"])
        assert torch.equal(got, expected)
        for model_layer, step_layer in zip(model_cache.layers, step_cache.layers, strict=True):
            assert torch.equal(model_layer.keys, step_layer.keys)
            assert torch.equal(model_layer.values, step_layer.values)


def test_a_hooked_projection_still_runs_its_hook():
    """A module the step would read the weights of, hooked, is called as a module: its hook runs at every step and
    changes the logits as it changes the model's."""
    model = _model("qwen2")
    calls = []

    def scale(module, args, output):
        calls.append(output.shape)
        return output * 1.5

    model.model.layers[1].self_attn.v_proj.register_forward_hook(scale)
    for expected, got, *_ in _decode_both_ways(model, padded=True, steps=3):
        assert torch.equal(got, expected)
    # Each of the 3 steps runs the hook twice (the model's forward and the step), after the two prefills.
    assert calls[2:] == [torch.Size([5, 1, 16])] * 6


def test_a_lora_model_s_adapters_run_in_the_step():
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:  # zero at creation: make the adapters change the output
            torch.nn.init.normal_(parameter, std=0.5)
    inner = peft_model.base_model.model  # the Llama model, its linear layers now peft's
    with torch.inference_mode():
        assert DecodeStep.of(peft_model, DynamicCache(config=inner.config)) is None  # the wrapper itself: not served
        adapted = _prefilled(inner, padded=True)[1]
        with peft_model.disable_adapter():
            assert not torch.equal(_prefilled(inner, padded=True)[1], adapted)  # the adapters change the logits
    for expected, got, *_ in _decode_both_ways(inner, padded=True, steps=3):
        assert torch.equal(got, expected)


def _hook_on_a_layer(model):
    model.model.layers[0].register_forward_hook(lambda module, args, output: output)
    return model


def _forward_of_its_own(model):
    model.model.layers[1].self_attn.forward = model.model.layers[1].self_attn.forward
    return model


def _checkpointing_in_training(model):
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    return model.train()


@pytest.mark.parametrize(
    "make",
    [
        lambda: GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval(),
        lambda: _model("qwen2", attn_implementation="eager"),
        lambda: _model("qwen2", layer_types=["full_attention", "sliding_attention"], use_sliding_window=True),
        lambda: _hook_on_a_layer(_model("qwen3")),
        lambda: _forward_of_its_own(_model("llama")),
        lambda: _checkpointing_in_training(_model("qwen2")),
    ],
    ids=[
        "another_architecture",
        "eager_attention",
        "sliding_window",
        "hooked_layer",
        "instance_forward",
        "checkpointing",
    ],
)
def test_the_step_is_refused_where_a_skipped_wrapper_could_change_what_runs(make):
    model = make()
    assert DecodeStep.of(model, DynamicCache(config=model.config)) is None


def test_the_step_is_refused_for_another_cache_and_under_a_global_hook():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = _model("qwen2")
    assert DecodeStep.of(model, DynamicCache(config=model.config)) is not None
    assert DecodeStep.of(model, object()) is None
    sliding = DynamicCache(config=model.config)
    sliding.layers[0] = DynamicSlidingWindowLayer(sliding_window=4)
    assert DecodeStep.of(model, sliding) is None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: output)
    try:
        assert DecodeStep.of(model, DynamicCache(config=model.config)) is None
    finally:
        handle.remove()


def test_the_sampler_draws_the_same_with_the_step_as_with_the_model(tiny_policy, monkeypatch):
    """The shipped tiny policy (Qwen2), a GRPO-like batch whose rows end at different lengths (and leave the batch),
    then a dialog's next turn from the kept caches: the same tokens, log-probs and kept caches whether each step runs
    through the step or the model's forward; the step served every decoding step of both calls."""
    model, tokenizer = tiny_policy
    conversations = [[{"role": "user", "content": text}] for text in ("Review the chair.", "What of the lamp's color?")]
    prompts = tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
    tokens, mask = prompts["input_ids"].repeat_interleave(4, 0), prompts["attention_mask"].repeat_interleave(4, 0)
    settings = SamplingSettings(max_new_tokens=12, top_k=20)
    torch.manual_seed(3)
    first = sample_responses(
        model, tokens, mask, settings=settings, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0
    )
    # Two tokens that row 0 and row 5 drew early also end a response: rows end at different steps.
    eos = sorted({tokenizer.eos_token_id, int(first.tokens[0, 2]), int(first.tokens[5, 6])})
    options = {"eos_token_ids": eos, "pad_token_id": tokenizer.pad_token_id, "keep_cache": True}
    steps = []
    original = DecodeStep.__call__

    def counted(self, *args):
        steps.append(args[0].shape[0])
        return original(self, *args)

    monkeypatch.setattr(DecodeStep, "__call__", counted)

    def both_ways(tokens, mask, **extra):
        """The draws through the step, and through the model's forward (``DecodeStep.of`` refusing every model)."""
        steps.clear()
        torch.manual_seed(3)
        with_step = sample_responses(model, tokens, mask, settings=settings, **options, **extra.get("step", {}))
        assert len(steps) == with_step.tokens.shape[1] - 1  # every decoding step after the prefill's
        with monkeypatch.context() as patch:
            patch.setattr(sampler_module.DecodeStep, "of", classmethod(lambda cls, model, cache: None))
            torch.manual_seed(3)
            with_model = sample_responses(model, tokens, mask, settings=settings, **options, **extra.get("model", {}))
        assert torch.equal(with_step.tokens, with_model.tokens)
        assert torch.equal(with_step.mask, with_model.mask)
        assert torch.equal(with_step.log_probs, with_model.log_probs)
        (step_layers, step_mask, _), (model_layers, model_mask, _) = (
            with_step.kept._assemble(),
            with_model.kept._assemble(),
        )
        assert torch.equal(step_mask, model_mask)
        for step_layer, model_layer in zip(step_layers, model_layers, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(step_layer, model_layer, strict=True))
        return with_step, with_model

    with_step, with_model = both_ways(tokens, mask)
    lengths = with_step.mask.sum(-1)
    assert lengths.min() < lengths.max()  # rows ended at different steps: some left the decoding batch early
    # The next turn: each row's context, its prompt and response and three more tokens, from its kept cache.
    contexts = [
        torch.cat([row[keep.bool()], response[taken], torch.tensor([5, 6, 7])])
        for row, keep, response, taken in zip(tokens, mask, with_step.tokens, with_step.mask, strict=True)
    ]
    width = max(len(context) for context in contexts)
    grown = torch.zeros(len(contexts), width, dtype=torch.long)
    grown_mask = torch.zeros_like(grown)
    for index, context in enumerate(contexts):
        grown[index, width - len(context) :], grown_mask[index, width - len(context) :] = context, 1
    both_ways(grown, grown_mask, step={"past": with_step.kept}, model={"past": with_model.kept})


def test_a_patched_modeling_class_runs_its_own_forward(monkeypatch):
    """A library that binds the modeling module's names to classes of its own (as kernel libraries patch
    ``modeling_qwen2.Qwen2MLP``): a patched MLP is called as a module, its forward run at every step; a patched
    attention class, whose forward the step would skip, is refused."""
    from transformers.models.qwen2 import modeling_qwen2

    calls = []

    class CountingMLP(modeling_qwen2.Qwen2MLP):
        def forward(self, x):
            calls.append(x.shape)
            return super().forward(x)

    monkeypatch.setattr(modeling_qwen2, "Qwen2MLP", CountingMLP)
    model = _model("qwen2")
    assert isinstance(model.model.layers[0].mlp, CountingMLP)
    for expected, got, *_ in _decode_both_ways(model, padded=False, steps=2):
        assert torch.equal(got, expected)
    assert len(calls) == 2 * 2 + 2 * 2 * 2  # 2 layers: the 2 prefills, then the model and the step at each step

    class OwnAttention(modeling_qwen2.Qwen2Attention):
        pass

    monkeypatch.setattr(modeling_qwen2, "Qwen2Attention", OwnAttention)
    model = _model("qwen2")
    assert DecodeStep.of(model, DynamicCache(config=model.config)) is None


def test_trl_s_fused_head_forward_is_served_and_another_wrapper_is_not():
    """``trl.GRPOTrainer`` sets ``add_fused_lm_head``'s forward on its model, which passes a plain call through to the
    class's forward: the step serves it, with the model's logits. A wrapper of another kind, or trl's over another
    wrapper, is refused."""
    import functools

    from trl.trainer.utils import add_fused_lm_head

    model = _model("qwen2")
    add_fused_lm_head(model)
    assert "forward" in vars(model)
    for expected, got, *_ in _decode_both_ways(model, padded=True, steps=2):
        assert torch.equal(got, expected)

    wrapped = _model("qwen2")
    plain = wrapped.forward
    wrapped.forward = functools.wraps(plain)(lambda *args, **kwargs: plain(*args, **kwargs))
    assert DecodeStep.of(wrapped, DynamicCache(config=wrapped.config)) is None
    add_fused_lm_head(wrapped)  # trl's forward over the wrapper
    assert DecodeStep.of(wrapped, DynamicCache(config=wrapped.config)) is None
