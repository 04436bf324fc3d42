"""scripts/estimate_memory.py: exact parameter bytes against the loaded tiny policy, AdamW's two moments, fsdp's
sharding, a largest-fitting batch that grows with the device's memory, and the activation model's shape (one layer
kept when checkpointed, linear in the tokens). Meta-device models, except the slow ``--measure`` run under torchrun."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from _processes import free_port
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


def test_fsdp_over_two_processes_halves_the_policy_its_optimizer_and_the_frozen_models(tiny_dir):
    ddp = estimate_memory.main(["--prompt-tokens", "16"])
    fsdp = estimate_memory.main(["--prompt-tokens", "16", "--processes", "2", "distributed.strategy=fsdp"])
    for key in ("parameters", "gradients", "optimizer", "reference_model", "reward_model"):
        assert fsdp[key] == pytest.approx(ddp[key] / 2)
    # The units running hold their whole weights: the root's (embeddings, norm, head) and two decoder layers'.
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "policy", dtype=torch.float32)
    layer_bytes = [sum(p.numel() * 4 for p in layer.parameters()) for layer in model.model.layers]
    total = sum(p.numel() * 4 for p in model.parameters())
    assert fsdp["fsdp_gathered_weights"] == total - sum(layer_bytes) + sum(sorted(layer_bytes)[-2:])
    assert ddp["fsdp_gathered_weights"] == 0
    assert fsdp["update_phase"] >= fsdp["fsdp_gathered_weights"] + fsdp["activations_without_checkpointing"]


def test_a_lora_policy_holds_no_separate_reference():
    lora = "model.lora={r:8,alpha:16,dropout:0.0,target_modules:[q_proj,v_proj]}"
    figures = estimate_memory.main(["--prompt-tokens", "16", lora])
    assert figures["reference_model"] == 0  # the reference is the policy with its adapters off
    assert 0 < figures["gradients"] < estimate_memory.main(["--prompt-tokens", "16"])["gradients"]


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


def test_runs_as_a_user_runs_it(repo_root, capfd):
    """Its command line, ``__main__`` included (in this process: tests/_in_process.run_script)."""
    from _in_process import run_script

    returncode = run_script(repo_root / "scripts" / "estimate_memory.py", "--device-memory", "80GiB")
    output = capfd.readouterr()
    assert returncode == 0, output.err[-3000:]
    assert "optimizer state (AdamW, 2 moments)" in output.out
    assert "Fits in 80.00 GiB" in output.out


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


def test_bf16_autocast_keeps_the_norms_and_the_residual_stream_in_float32():
    shape = {"layers": 4, "hidden": 256, "kv": 128, "mlp": 768, "vocab": 463}
    tokens = 8 * 48
    plain = estimate_memory.update_activation_bytes(shape, sequences=8, length=48, responses=32, element=2)
    autocast = estimate_memory.update_activation_bytes(
        shape, sequences=8, length=48, responses=32, element=2, autocast=True
    )
    norms = tokens * 4 * 256 * 4  # per layer: the two norms' float32 inputs and outputs
    final_norm = 2 * tokens * 256 * (4 - 2)
    assert autocast["without_checkpointing"] - plain["without_checkpointing"] == 4 * norms + final_norm
    # Checkpointed, each layer keeps its float32 input, and the recomputed layer its norms.
    kept_inputs = 4 * tokens * 256 * (4 - 2)
    assert autocast["with_checkpointing"] - plain["with_checkpointing"] == kept_inputs + norms + final_norm


@pytest.mark.slow
def test_measure_under_torchrun_with_fsdp_reports_once_and_close_to_the_estimate(repo_root, tmp_path):
    """Each process shards the tiny policy (FSDP2, gloo), runs one update and measures it; the main process reports
    the largest, beside the estimate for 2 processes. New Pythons on purpose: ranks forked from a test worker that had
    run other tests measured the update's resident memory growth at 0.15x the estimate (3.3 MB of 21 MB, 2026-12-06:
    the update reused the parent's freed memory), so the measurement needs fresh processes."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(repo_root / "scripts" / "estimate_memory.py"),
            "--measure",
            "--json",
            str(tmp_path / "figures.json"),
            "distributed.strategy=fsdp",
            "model.lora={r:8,alpha:16,dropout:0.0,target_modules:[q_proj,v_proj,lm_head]}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo_root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("Measured one update") == 1
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["setting"]["processes"] == 2 and figures["setting"]["lora"]
    assert figures["fsdp_gathered_weights"] > 0
    # The README's measurements at this size lie within 0.85-1.11; the band leaves room for the allocator.
    assert 0.7 <= figures["measured_update"] / figures["measured_estimate"] <= 1.4


def test_a_device_memory_past_the_search_says_at_least_and_refused_configs_are_not_estimated(tiny_dir, tmp_path):
    huge = estimate_memory.main(["--prompt-tokens", "16", "--device-memory", "1000000TiB"])["fitting"]
    assert all(row["at_least"] and row["responses_per_step"] > 0 for row in huge)
    assert not any(row["at_least"] for row in estimate_memory.main(["--device-memory", "4GiB"])["fitting"])
    with pytest.raises(SystemExit, match=r"the recipe refuses this config: model.lora.target_modules: \['q_prj'\]"):
        estimate_memory.main(["model.lora.target_modules=[q_prj]"])
    with pytest.raises(SystemExit, match=r"the recipe refuses this config: model.name_or_path=.*no such model folder"):
        estimate_memory.main([f"model.name_or_path={tmp_path / 'absent'}"])


def test_an_adapter_reward_model_is_estimated_as_its_base(tiny_dir, tmp_path):
    """GRPO scores with an adapter folder as its reward model: the estimate counts its base (the adapter merged)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = AutoModelForSequenceClassification.from_pretrained(tiny_dir / "reward_model", num_labels=1)
    adapted = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["q_proj"]))
    adapted.save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(tiny_dir / "reward_model").save_pretrained(tmp_path / "adapter")
    plain = estimate_memory.main(["--prompt-tokens", "16"])
    with_adapter = estimate_memory.main(["--prompt-tokens", "16", f"reward_model.name_or_path={tmp_path / 'adapter'}"])
    assert with_adapter["reward_model"] == plain["reward_model"]


def test_eval_sampling_is_counted_where_it_holds_more_than_the_rollout():
    """The evaluation samples eval.group_size answers to each of responses_per_step / eval.group_size prompts in one
    decoding loop: with a larger group than the step's responses, its KV cache outgrows the rollout's, and the peak
    counts it (it was left out)."""
    no_eval = ["eval.every_n_steps=null", "metric=rollout/reward_mean_last"]
    off = estimate_memory.main(["--prompt-tokens", "16", "experiment=arithmetic", *no_eval])
    assert off["eval_generation_kv_cache"] == 0
    same = estimate_memory.main(["--prompt-tokens", "16", "experiment=arithmetic"])  # 16 prompts x 4 answers
    assert same["eval_generation_kv_cache"] == same["generation_kv_cache"] and same["peak"] == off["peak"]
    large = estimate_memory.main(["--prompt-tokens", "16", "experiment=arithmetic", "eval.group_size=4096"])
    assert large["eval_generation_kv_cache"] == 64 * large["generation_kv_cache"]  # 1 prompt x 4096 answers, not 64
    persistent = sum(large[key] for key in ("parameters", "optimizer", "reference_model", "reward_model"))
    assert large["eval_generation_kv_cache"] > large["update_phase"]
    assert large["peak"] == persistent + large["eval_generation_kv_cache"]
    longer = estimate_memory.main(
        ["--prompt-tokens", "16", "experiment=arithmetic", "eval.generation.max_new_tokens=40"]
    )
    assert longer["eval_generation_kv_cache"] == same["eval_generation_kv_cache"] * (16 + 40) / (16 + 12)


@pytest.mark.parametrize(
    ("override", "answer"),
    [
        ("num_generations=4", "set rollout.group_size=4"),
        ("train.learning_rate=1e-3", "set optimizer.lr=1e-3"),
        ("+loss.beta=0.1", "set loss.kl_to_ref_coeff=0.1"),
    ],
)
def test_a_trl_key_is_answered_with_the_recipes_key_not_a_traceback(capsys, override, answer):
    with pytest.raises(SystemExit) as stopped:
        estimate_memory.main([override])
    shown = str(stopped.value.code) + capsys.readouterr().err
    assert answer in shown and "Traceback" not in shown


def test_shared_prompts_and_token_micro_batches_shrink_the_update_activations(tiny_dir):
    """train.share_prompt computes each group's prompt once (its keys and values still read by every row);
    train.max_tokens_per_micro_batch bounds the sequences of one forward."""
    shape = {"hidden": 64, "kv": 32, "mlp": 192, "layers": 2, "vocab": 463}
    padded = estimate_memory.update_activation_bytes(shape, sequences=16, length=48, responses=32, element=4)
    shared = estimate_memory.update_activation_bytes(shape, sequences=16, length=48, responses=32, element=4, prompts=2)
    # 14 of 16 prompts' 16 tokens less: each layer's 8 h + 4 m per token, the final norm's 2 h and a layer backward's
    # 2 m; the 2 kv per token of every row's whole keys and values stay.
    fewer = (16 - 2) * 16
    saved = fewer * (2 * (8 * 64 + 4 * 192) + 2 * 64 + 2 * 192) * 4
    assert padded["without_checkpointing"] - shared["without_checkpointing"] == saved
    cfg = estimate_memory.compose_config(["train.mini_batch_size=64"])
    whole = estimate_memory.estimate(cfg, processes=1, prompt_tokens=16)
    assert whole["setting"]["distinct_prompts"] == 8 and whole["setting"]["update_sequences"] == 64
    no_sharing = estimate_memory.estimate(
        estimate_memory.compose_config(["train.mini_batch_size=64", "train.share_prompt=false"]),
        processes=1,
        prompt_tokens=16,
    )
    assert no_sharing["activations_without_checkpointing"] > whole["activations_without_checkpointing"]
    budget = estimate_memory.estimate(
        estimate_memory.compose_config(["train.mini_batch_size=64", "train.max_tokens_per_micro_batch=480"]),
        processes=1,
        prompt_tokens=16,
    )
    assert budget["setting"]["update_sequences"] == 10  # 480 tokens // 48 per sequence
    assert budget["activations_without_checkpointing"] < whole["activations_without_checkpointing"]


def test_the_chunked_heads_kept_logits_are_counted_within_their_budget():
    from recipes.grpo import log_probs

    """At a real vocabulary an update of 16 responses of 32 tokens keeps its 512 x 151,936 float32 logits for the
    backward (within KEEP_ELEMENTS); at 16x the rows they are recomputed, one chunk at a time."""
    shape = {"hidden": 512, "kv": 256, "mlp": 1536, "layers": 6, "vocab": 151936}

    def head_bytes(sequences: int) -> int:
        with_head = estimate_memory.update_activation_bytes(
            shape, sequences=sequences, length=48, responses=32, element=4
        )
        tiny_vocab = {**shape, "vocab": 1}
        without = estimate_memory.update_activation_bytes(
            tiny_vocab, sequences=sequences, length=48, responses=32, element=4
        )
        return with_head["without_checkpointing"] - without["without_checkpointing"]

    # One chunk of the vocabulary at a time: CACHE_CHUNK_ELEMENTS logits' columns over the rows.
    per_chunk = log_probs.CACHE_CHUNK_ELEMENTS
    assert head_bytes(16) == 512 * 151936 * 4 + 3 * 512 * (per_chunk // 512) * 4 - 3 * 512 * 4
    assert head_bytes(256) == 3 * 8192 * (per_chunk // 8192) * 4 - 3 * 256 * 32 * 4


def test_the_scorers_buffers_kept_on_cpu_are_counted_where_the_head_is_chunked():
    """On CPU each scorer keeps its chunked head's buffers from one call to the next (recipes/grpo/log_probs.py): two
    chunks, the policy's kept logits within KEEP_ELEMENTS and the head's gradient; nothing where the head is whole."""
    from recipes.grpo.log_probs import CACHE_CHUNK_ELEMENTS

    chunk = 512 * (CACHE_CHUNK_ELEMENTS // 512)
    assert estimate_memory.scorer_buffers_held(512, 151936, head_gradient=7) == 2 * chunk * 4 + 512 * 151936 * 4 + 7
    assert estimate_memory.scorer_buffers_held(8192, 151936) == 2 * 8192 * (chunk // 8192) * 4  # recomputed, not kept
    assert estimate_memory.scorer_buffers_held(16, 463, head_gradient=7) == 0  # the tiny head, whole

    def figures(*overrides):
        batch = ["train.mini_batch_size=1024", "rollout.responses_per_step=1024", "rollout.group_size=8"]
        return estimate_memory.estimate(
            estimate_memory.compose_config([*batch, *overrides]), processes=1, prompt_tokens=16
        )

    cpu, gpu = figures("device=cpu"), figures("device=cuda")
    assert gpu["cpu_scorer_buffers"] == gpu["cpu_reference_scorer_buffers"] == 0
    # 1,024 x 32 response rows x 463 > CHUNK_ELEMENTS: chunked, beyond KEEP_ELEMENTS (recomputed), the head trainable.
    rows, vocab, hidden = 1024 * 32, 463, 64
    assert cpu["cpu_scorer_buffers"] == estimate_memory.scorer_buffers_held(rows, vocab) + vocab * hidden * 4
    assert cpu["cpu_reference_scorer_buffers"] == estimate_memory.scorer_buffers_held(rows, vocab)
    persistent = sum(cpu[key] for key in ("parameters", "optimizer", "reference_model", "reward_model"))
    held = cpu["cpu_scorer_buffers"] + cpu["cpu_reference_scorer_buffers"]
    assert cpu["peak"] >= persistent + held + cpu["generation_kv_cache"]
    assert cpu["peak"] >= persistent + cpu["update_phase"] + cpu["cpu_reference_scorer_buffers"]


def test_the_samplers_packed_head_is_counted_in_generation_on_cpu_where_it_packs(tmp_path, tiny_dir):
    """A decoding loop of 9 rows or more and 8 tokens or more packs a float32 head of at least 2M weights for oneDNN
    on CPU (interop/sampling/sampler.py): one more copy of the head's weight while it runs; nothing elsewhere."""
    from interop.sampling.sampler import _packing_available

    packed = estimate_memory.sampler_packed_head_bytes
    real = {"element": 4, "device": "cpu", "new_tokens": 32}
    assert packed(16, 151936, 512, **real) == (151936 * 512 * 4 if _packing_available() else 0)
    assert packed(8, 151936, 512, **real) == 0  # too few rows to pack
    assert packed(16, 151936, 512, **real | {"new_tokens": 7}) == 0  # too few tokens
    assert packed(16, 151936, 512, **real | {"element": 2}) == 0  # bfloat16: the model's own head
    assert packed(16, 151936, 512, **real | {"device": "cuda"}) == 0
    assert packed(64, 463, 64, **real) == 0  # the tiny head

    # The tiny policy with a 32,768-token head (2.1M weights): the estimate reads its config only.
    wide = tmp_path / "policy"
    shutil.copytree(tiny_dir / "policy", wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(config | {"vocab_size": 32_768}))

    def figures(responses, device="cpu"):
        overrides = [f"model.name_or_path={wide}", f"rollout.responses_per_step={responses}", f"device={device}"]
        overrides.append("train.mini_batch_size=8")
        return estimate_memory.estimate(estimate_memory.compose_config(overrides), processes=1, prompt_tokens=16)

    head = 32_768 * 64 * 4
    packing = figures(64)
    assert packing["cpu_sampler_packed_head"] == (head if _packing_available() else 0)
    persistent = sum(packing[key] for key in ("parameters", "optimizer", "reference_model", "reward_model"))
    held = packing["cpu_scorer_buffers"] + packing["cpu_reference_scorer_buffers"]
    assert packing["peak"] >= persistent + held + packing["generation_kv_cache"] + packing["cpu_sampler_packed_head"]
    assert figures(8)["cpu_sampler_packed_head"] == figures(64, "cuda")["cpu_sampler_packed_head"] == 0
