"""recipes.grpo.policy: checkpointing that really recomputes in the eval-mode policy, with the same gradients, and
bf16 autocast over float32 weights; and a GRPO run with both switches on."""

from __future__ import annotations

import math

import pytest
import torch
from _small_runs import GRPO_SMALL, read_metrics
from transformers import AutoModelForCausalLM

import recipes.grpo_torchrl_rm as recipe
from recipes.grpo.log_probs import ResponseLogProbs
from recipes.grpo.policy import enable_activation_checkpointing, update_forward


@pytest.fixture
def policy(tiny_dir):
    # A fresh copy: these tests switch checkpointing on, which the session's shared tiny policy must not keep.
    return AutoModelForCausalLM.from_pretrained(tiny_dir / "policy").eval()


def _batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 400, (4, 12), generator=generator)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[0, :3] = False  # a left-padded prompt
    mask[1, -2:] = False  # a response that ended early
    return tokens, mask


def _gradients_and_mlp_calls(model, *, mixed_precision="no"):
    """One loss forward (in update_forward) and backward; the weights' gradients and how often an MLP started (a
    pre-hook: the recomputation stops early, once it has every saved tensor back, before the MLP's forward ends)."""
    calls = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in model.model.layers]
    tokens, mask = _batch()
    model.zero_grad(set_to_none=True)
    with update_forward(model, mixed_precision=mixed_precision, device="cpu"):
        log_probs, _ = ResponseLogProbs(model)(tokens, mask, response_start=6)
        loss = -log_probs.sum()
    loss.backward()
    for hook in hooks:
        hook.remove()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, len(calls), log_probs


def test_checkpointing_recomputes_in_the_eval_mode_policy_with_the_same_gradients(policy):
    plain, plain_calls, _ = _gradients_and_mlp_calls(policy)
    layers = len(policy.model.layers)
    assert plain_calls == layers

    enable_activation_checkpointing(policy)
    checkpointed, checkpointed_calls, _ = _gradients_and_mlp_calls(policy)
    # Every layer ran twice: once in the forward, once recomputed in the backward.
    assert checkpointed_calls == 2 * layers
    assert not policy.training and not any(module.training for module in policy.modules())  # back to eval, all
    for name, gradient in plain.items():
        torch.testing.assert_close(checkpointed[name], gradient, rtol=1e-5, atol=1e-7, msg=name)


def test_outside_update_forward_an_eval_policy_is_not_checkpointed(policy):
    # What transformers 5 does on its own (layers checkpoint only in training mode), and why update_forward exists.
    enable_activation_checkpointing(policy)
    tokens, mask = _batch()
    calls = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in policy.model.layers]
    ResponseLogProbs(policy)(tokens, mask, response_start=6)[0].sum().backward()
    for hook in hooks:
        hook.remove()
    assert len(calls) == len(policy.model.layers)


def test_bf16_autocast_keeps_float32_weights_and_gradients_close_to_float32(policy):
    full, _, _ = _gradients_and_mlp_calls(policy)
    enable_activation_checkpointing(policy)  # both switches together, as a memory-bound run would set them
    mixed, _, log_probs = _gradients_and_mlp_calls(policy, mixed_precision="bf16")
    assert log_probs.dtype == torch.float32  # the log-softmax runs in float32 over bf16 logits
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    for name, gradient in full.items():
        assert mixed[name].dtype == torch.float32
        # bf16 keeps 8 bits of mantissa: the gradients agree in direction and to a few percent in size.
        cosine = torch.nn.functional.cosine_similarity(mixed[name].flatten(), gradient.flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))
    assert not torch.equal(mixed["model.layers.0.mlp.up_proj.weight"], full["model.layers.0.mlp.up_proj.weight"])


def test_grpo_trains_with_checkpointing_and_bf16_autocast(compose_config, tmp_path):
    """The same first update as a float32 run without checkpointing (the same rollouts: sampling is not autocast),
    to bf16's precision: its gradient norm within 5% and its rewards equal; both steps' figures finite."""
    base = [*GRPO_SMALL, "train.steps=2", "logger=csv", "samples.every_n_steps=null", "checkpoint.every_n_steps=null"]
    switches = ["train.gradient_checkpointing=true", "train.mixed_precision=bf16"]
    summary = recipe.train(compose_config("grpo_torchrl_rm", [*base, *switches, f"output_dir={tmp_path / 'bf16'}"]))
    recipe.train(compose_config("grpo_torchrl_rm", [*base, f"output_dir={tmp_path / 'fp32'}"]))
    mixed, full = read_metrics(tmp_path / "bf16"), read_metrics(tmp_path / "fp32")
    assert summary["train/steps"] == 2 and len(mixed) == 2
    assert all(math.isfinite(row[key]) for row in mixed for key in ("train/loss", "train/grad_norm"))
    assert mixed[0]["rollout/reward_mean"] == full[0]["rollout/reward_mean"]
    assert mixed[0]["train/grad_norm"] > 0
    assert mixed[0]["train/grad_norm"] == pytest.approx(full[0]["train/grad_norm"], rel=0.05)
