"""scripts/estimate_memory.py: exact parameter bytes against the loaded tiny policy, AdamW's two moments, fsdp's
sharding, a largest-fitting batch that grows with the device's memory, and the activation model's shape (one layer
kept when checkpointed, linear in the tokens). Meta-device models only: fast; nothing measured."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "scripts"))
import estimate_memory  # noqa: E402

GIB = 2**30


def test_parameter_and_optimizer_bytes_are_those_of_the_loaded_tiny_policy(tiny_dir):
    figures = estimate_memory.main(["--prompt-tokens", "16"])
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "policy", dtype=torch.float32)
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    assert figures["parameters"] == loaded
    assert figures["gradients"] == loaded
    assert figures["optimizer"] == 2 * sum(p.numel() * 4 for p in model.parameters())  # AdamW: 2 float32 moments
    assert figures["reference_model"] == loaded  # loss.kl_to_ref_coeff > 0 by default
    assert figures["activations_with_checkpointing"] < figures["activations_without_checkpointing"]


def test_fsdp_over_two_processes_halves_parameters_gradients_and_optimizer():
    ddp = estimate_memory.main(["--prompt-tokens", "16"])
    fsdp = estimate_memory.main(["--prompt-tokens", "16", "--processes", "2", "distributed.strategy=fsdp"])
    for key in ("parameters", "gradients", "optimizer"):
        assert fsdp[key] == pytest.approx(ddp[key] / 2)
    assert fsdp["reward_model"] == ddp["reward_model"]


def test_no_reference_without_kl_and_bf16_autocast_adds_weight_copies():
    figures = estimate_memory.main(["--prompt-tokens", "16", "loss.kl_to_ref_coeff=0", "train.mixed_precision=bf16"])
    assert figures["reference_model"] == 0
    assert figures["autocast_weight_copies"] == figures["parameters"] / 2


def test_largest_fitting_batch_grows_with_device_memory():
    small = estimate_memory.main(["--prompt-tokens", "16", "--device-memory", "256MiB"])["fitting"]
    large = estimate_memory.main(["--prompt-tokens", "16", "--device-memory", "4GiB"])["fitting"]
    for before, after in zip(small, large, strict=True):
        assert after["responses_per_step"] > before["responses_per_step"] > 0
        assert before["responses_per_step"] % 8 == 0  # multiples of rollout.group_size
    assert [row["responses_per_step"] for row in small] == sorted(
        (row["responses_per_step"] for row in small), reverse=True
    )


def test_runs_as_a_user_runs_it(repo_root):
    result = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "estimate_memory.py"), "--device-memory", "80GiB"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo_root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "optimizer state (AdamW, 2 moments)" in result.stdout
    assert "Fits in 80.00 GiB" in result.stdout


def test_checkpointed_activations_hold_one_layer_and_less_than_all():
    figures = estimate_memory.main(["--prompt-tokens", "16"])
    one_layer = figures["activations_last_layer"]
    assert one_layer < figures["activations_with_checkpointing"] < figures["activations_without_checkpointing"]
    # The backward ends with every gradient and the first layer's activations held.
    assert figures["update_phase"] >= figures["gradients"] + one_layer


def test_activations_scale_linearly_with_mini_batch_tokens():
    # A small vocabulary: the head's logits stay under the chunk cap, so every term is proportional to the tokens.
    shape = {"layers": 4, "hidden": 256, "kv": 128, "mlp": 768, "vocab": 463}
    base = estimate_memory.update_activation_bytes(shape, sequences=8, length=48, responses=32, element=4)
    for sequences, length, responses, factor in ((16, 48, 32, 2), (8, 96, 64, 2), (32, 96, 64, 8)):
        scaled = estimate_memory.update_activation_bytes(
            shape, sequences=sequences, length=length, responses=responses, element=4
        )
        assert scaled == {key: value * factor for key, value in base.items()}
    # Checkpointing keeps one [tokens, h] per layer instead of a layer's activations: the saving grows with depth.
    deeper = estimate_memory.update_activation_bytes(
        dict(shape, layers=8), sequences=8, length=48, responses=32, element=4
    )
    layer = base["last_layer"] - 2 * 8 * 48 * 768 * 4  # less its backward's two [tokens, m] gradients
    assert deeper["without_checkpointing"] - base["without_checkpointing"] == 4 * layer
    assert deeper["with_checkpointing"] - base["with_checkpointing"] == 4 * 8 * 48 * 256 * 4


def test_optimizer_step_temporaries_follow_the_device_default():
    cpu = estimate_memory.main(["--prompt-tokens", "16"])
    cuda = estimate_memory.main(["--prompt-tokens", "16", "device=cuda"])  # meta models: no GPU needed
    assert cuda["optimizer_step_temporaries"] == cuda["gradients"]  # foreach: one sqrt(exp_avg_sq) of every parameter
    assert cpu["optimizer_step_temporaries"] == 2 * cpu["largest_trainable_bytes"]  # per parameter: two of the largest
