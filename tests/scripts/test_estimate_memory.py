"""scripts/estimate_memory.py: exact parameter bytes against the loaded tiny policy, AdamW's two moments, fsdp's
sharding, and a largest-fitting batch that grows with the device's memory. Meta-device models only: fast."""

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
