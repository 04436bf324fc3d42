"""Per-device memory of a GRPO run (``recipes/grpo_torchrl_rm.py``), estimated from the model configs alone.

    python scripts/estimate_memory.py                                          # the default (tiny) run
    python scripts/estimate_memory.py model=qwen2_5_0_5b_instruct reward_model=skywork_reward_v2_qwen3_0_6b \\
        train.mixed_precision=bf16 train.gradient_checkpointing=true --device-memory 80GiB
    python scripts/estimate_memory.py distributed.strategy=fsdp --processes 8 --device-memory 80GiB
    python scripts/estimate_memory.py --measure                                # and one real update on CPU, measured

The recipe's config is composed from ``conf/`` with the overrides given (as the recipe itself would run); the models
are built from their configs on the ``meta`` device, so nothing is loaded and any size can be estimated on a laptop.
What it prints, per device (one process):

- parameters: the policy's, in ``dtype`` (``sum(numel * element_size)``, tied weights once).
- gradients: one per trainable parameter, in its dtype (LoRA with ``model.lora``: the adapters' only).
- optimizer: AdamW's two moments per trainable parameter (``torch.optim.AdamW`` keeps them in the parameter's dtype:
  float32 under ``dtype=float32``, also with ``train.mixed_precision=bf16``, where the float32 weights are themselves
  the master copy and nothing else is kept).
- autocast weight copies: under ``train.mixed_precision=bf16``, the bfloat16 casts of the weights autocast holds during
  a forward.
- reference model: the frozen initial policy, when ``loss.kl_to_ref_coeff`` > 0 and the policy has no LoRA adapters
  (with ``model.lora`` the reference is the policy with its adapters off: nothing more is held).
- reward model: the sequence classifier.
- fsdp gathered weights: under ``distributed.strategy=fsdp``, the full weights of the units being run beside their
  shards: the root's (embeddings, final norm, LM head), which FSDP2 keeps gathered from a forward to its backward,
  and two decoder layers (the one running and the next, prefetched).
- activations of the update: kept for the backward of one mini-batch of ``train.mini_batch_size`` sequences of
  (prompt + ``max_new_tokens``) tokens (with ``train.max_tokens_per_micro_batch``, of the whole sequences that fit
  that budget), with and without ``train.gradient_checkpointing``; with ``train.share_prompt`` each distinct prompt
  (at most one per group of the step) is computed once, the responses read its keys and values (every response
  counted ``max_new_tokens`` long: the passes by response length only save on shorter ones); the LM head projects
  the response positions only (``recipes/grpo/log_probs.py``), so no ``[B, T, V]`` logits, and at most ``2**23``
  logits per chunk beyond a size (the forward's chunks kept for the backward, up to ``2**27`` logits in all).
- generation: the KV cache of all ``rollout.responses_per_step`` sequences sampled in one decoding loop; reference
  scoring: one layer's activations of the whole batch (``rollout.log_prob_micro_batch_size``) without gradients.
- eval generation (``eval.every_n_steps`` set): the KV cache of one of the evaluation's decoding loops,
  ``eval.group_size`` answers to each of ``rollout.responses_per_step / eval.group_size`` eval prompts (fewer where a
  process has fewer), of (the longest eval prompt + ``eval.generation.max_new_tokens``) tokens: larger than the
  rollout's with a large ``eval.group_size``, longer eval prompts or answers.
- the sampler's packed head on CPU (``device=cpu``, a float32 head of at least 2M weights, a decoding loop of 9 rows
  or more and 8 tokens or more): a copy of the LM head's weight in oneDNN's layout, held while the loop runs.
- scorers' buffers kept on CPU (``device=cpu``): where the LM head is chunked, each scorer keeps its two chunk
  buffers, the policy's its kept logits and the head weight's gradient (one process, no LoRA) from one call to the
  next, through generation and scoring too (freed, glibc would return them to the system, and every step would
  page-fault on them anew).
- optimizer step temporaries: AdamW's foreach step (torch's default on CUDA) allocates one gradient-sized temporary,
  its per-parameter step (the default on CPU, ``device=cpu``) two of the largest parameter.
- peak: what stays allocated (parameters, optimizer state, reference and reward models) plus the largest phase:
  the update's backward (its activations, or every gradient + the first layer's activations, whichever is larger;
  + autocast copies and fsdp's gathered units), its optimizer step (gradients + temporaries), generation, eval
  generation or reference scoring (each + fsdp's gathered units; on CPU, + the scorers' kept buffers, and generation +
  the sampler's packed head).

Under ``distributed.strategy=fsdp`` (``--processes N``) parameters, gradients, optimizer state, the reference and the
reward model are divided by N, and the policy's gathered units added; under ddp (the default when the key is absent)
every process holds them whole. ``--device-memory 80GiB`` adds the largest ``rollout.responses_per_step`` (a
multiple of ``rollout.group_size``) that fits at the configured response length and at 2x, 4x and 8x of it.

The activation figures are a model, not a measurement: per token and decoder layer, ``8 h + 2 kv + 4 m`` elements
kept for the backward (``h`` hidden size, ``kv`` the key/value width, ``m`` the MLP width: the norms' inputs and
outputs, q, k and v after rotary, the attention output, the MLP's gate, up, activation and product), attention with
a fused kernel (no ``T x T`` scores), plus the final norm's and the response head's (logits of the response positions
only). Checkpointed, each layer keeps only its input ``[tokens, h]``, and the backward holds one recomputed layer's
activations at a time. Either way a layer's backward holds about two ``[tokens, m]`` gradients beside them, and the
backward's peak is at its start (the activations) or at its end (every gradient plus the first layer's activations).
``--measure`` runs one real update (forward, backward, AdamW step over random tokens) on CPU in this process and
prints the peak resident memory it added, for comparison with that model: glibc is first told to ``mmap`` every
block of 64 KiB or more, so that freed tensors leave the resident size (by default its heap keeps them, and the
resident peak of a checkpointed backward grows to about twice its live tensors: not what a device's allocator,
which reuses such blocks, would hold).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

from recipes.common.config import ConfigError  # noqa: E402
from recipes.common.schema import refuse_unknown_overrides  # noqa: E402
from recipes.grpo.log_probs import CHUNK_ELEMENTS, KEEP_ELEMENTS, chunk_columns  # noqa: E402  (the logits the scorer holds)

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"512MiB"`` or a number of bytes -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"--device-memory {text!r}: expected a size such as 80GiB, 40GB or 512MiB.")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def compose_config(overrides: list[str]):
    """The GRPO config of ``overrides`` as the recipe would train it: composed, then through the recipe's own
    validation (a config the recipe refuses is not estimated; LoRA is on as the command line says): its typed
    settings (``recipes.grpo.schema.GRPORecipeConfig``)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from recipes.grpo.checks import validate

    # The recipe's checks make sure its output folder can be written: a scratch one, removed at exit.
    scratch = tempfile.mkdtemp(prefix="estimate_memory_")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("grpo_torchrl_rm", overrides=[*overrides, f"output_dir={scratch}"], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
    # The estimate is for the machine the run will have: its device and dtype pass as they would on a GPU here.
    device, dtype = cfg.device, cfg.dtype
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        cfg.device, cfg.dtype = "cpu", "bfloat16" if dtype == "float16" else dtype
    cfg = validate(cfg)
    cfg.device, cfg.dtype = device, dtype
    return cfg


def meta_model(node, *, kind: str, dtype: torch.dtype):
    """The model of ``node`` (an adapter folder's base, for one) built from its config alone, on the meta device:
    shapes and dtypes, no memory (``recipes.common.models.meta_model``). Built once per model and dtype:
    ``largest_fitting`` estimates the same models at many batch sizes."""
    from omegaconf import OmegaConf

    from recipes.common.schema import config_view

    return _meta_model(OmegaConf.to_yaml(config_view(node)), kind, dtype)


@functools.lru_cache(maxsize=8)
def _meta_model(node_yaml: str, kind: str, dtype: torch.dtype):
    from omegaconf import OmegaConf

    from recipes.common import models

    return models.meta_model(OmegaConf.create(node_yaml), kind=kind, dtype=dtype)


def parameter_bytes(model) -> int:
    # parameters() yields a tied weight once, as a loaded model holds it once.
    return sum(p.numel() * p.element_size() for p in model.parameters())


def lora_parameter_count(model, lora) -> tuple[int, int]:
    """Adapter parameters of LoRA rank ``lora.r`` on every ``nn.Linear`` whose name ends in one of
    ``lora.target_modules`` (``"all-linear"``: every linear layer but the LM head), and the largest adapter matrix's."""
    targets = lora.target_modules
    head = model.get_output_embeddings()
    count = largest = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        if targets == "all-linear" or any(name == t or name.endswith(f".{t}") for t in targets):
            count += lora.r * (module.in_features + module.out_features)
            largest = max(largest, lora.r * max(module.in_features, module.out_features))
    return count, largest


def gathered_unit_bytes(model) -> int:
    """Bytes of the whole weights FSDP2 gathers at once: the root unit's (what no decoder layer holds) and the two
    largest decoder layers' (the one running and the next, prefetched)."""
    from recipes.common.sharding import decoder_layers

    layers = sorted((parameter_bytes(layer) for layer in decoder_layers(model)), reverse=True)
    return parameter_bytes(model) - sum(layers) + sum(layers[:2])


def optimizer_step_temporaries(*, trainable_bytes: float, largest_bytes: float, foreach: bool) -> float:
    """What AdamW's step allocates beside its state. torch's default on CUDA (and XPU) is the foreach
    implementation: one ``sqrt(exp_avg_sq)`` of every parameter at once (``_multi_tensor_adam``; AdamW's weight decay
    is in place). Elsewhere (CPU) it steps one parameter at a time, ``(exp_avg_sq.sqrt() / bias_correction).add_(eps)``:
    two temporaries of the largest parameter."""
    return trainable_bytes if foreach else 2 * largest_bytes


def prompt_tokens_of(cfg) -> int:
    """The longest training prompt rendered with the policy's chat template: the batch's prompt width."""
    from recipes.common.data import load_prompts
    from recipes.common.models import load_tokenizer
    from recipes.common.prompts import PromptTable
    from recipes.common.schema import config_view

    prompts = load_prompts(config_view(cfg.data), "train")
    table = PromptTable(prompts, tokenizer=load_tokenizer(cfg.model, padding_side="left"))
    return max(table.rendered_lengths())


def eval_prompts_of(cfg, *, processes: int, prompt_tokens: int | None = None) -> dict | None:
    """What one process's evaluation samples from (``None`` with ``eval.every_n_steps`` null): how many eval prompts
    it answers (the evaluator deals ``eval.num_prompts`` of them out evenly) and the longest, rendered with the
    policy's chat template (``prompt_tokens`` when given)."""
    from recipes.common.data import load_prompts
    from recipes.common.models import load_tokenizer
    from recipes.common.prompts import PromptTable
    from recipes.common.schema import config_view

    if cfg.eval.every_n_steps is None:
        return None
    prompts = load_prompts(config_view(cfg.data), "eval")
    count = len(prompts) if cfg.eval.num_prompts is None else min(int(cfg.eval.num_prompts), len(prompts))
    if prompt_tokens is None:
        table = PromptTable(prompts, tokenizer=load_tokenizer(cfg.model, padding_side="left"))
        prompt_tokens = max(table.rendered_lengths())
    return {"per_process": max(1, count // processes), "prompt_tokens": prompt_tokens}


def _shape(config) -> dict:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return {
        "layers": text.num_hidden_layers,
        "hidden": hidden,
        "kv": kv_heads * head_dim,
        "mlp": getattr(text, "intermediate_size", None) or 4 * hidden,
        "vocab": text.vocab_size,
    }


def sampler_packed_head_bytes(rows: int, vocab: int, hidden: int, *, element: int, device: str, new_tokens: int) -> int:
    """Bytes of the output head's weight the sampler packs for oneDNN while a decoding loop of ``rows`` rows and up to
    ``new_tokens`` tokens runs (``interop/sampling/sampler.py``): a float32 head of at least
    ``_ROWS_FIRST_MIN_WEIGHTS`` weights on CPU, a loop that packs (``_loop_packs_head``), a torch with oneDNN; 0
    otherwise."""
    from interop.sampling import sampler

    packs = (
        torch.device(device).type == "cpu"
        and element == 4
        and vocab * hidden >= sampler._ROWS_FIRST_MIN_WEIGHTS
        and sampler._loop_packs_head(rows, new_tokens)
        and sampler._packing_available()
    )
    return vocab * hidden * 4 if packs else 0


def head_chunk_logits(rows: int, vocab: int) -> int:
    """The logits the chunked LM head holds at once over ``rows`` rows: all of them within the scorer's budget
    (``CHUNK_ELEMENTS``), one chunk of the vocabulary beyond it."""
    return rows * vocab if rows * vocab <= CHUNK_ELEMENTS else rows * min(chunk_columns(rows), vocab)


def scorer_buffers_held(rows: int, vocab: int, *, head_gradient: int = 0) -> int:
    """Bytes a scorer keeps on CPU from one call to the next (``recipes/grpo/log_probs.py``'s workspace; freed, glibc
    would hand them back to the system and the next step would page-fault on them anew): where the head is chunked
    over ``rows`` rows, its two chunk buffers (float32), the kept logits within ``KEEP_ELEMENTS`` and ``head_gradient``
    (the head weight's gradient, taken back after each step in one process); nothing where the head is not chunked."""
    logits = rows * vocab
    if logits <= CHUNK_ELEMENTS:
        return 0
    return 2 * head_chunk_logits(rows, vocab) * 4 + (logits * 4 if logits <= KEEP_ELEMENTS else 0) + head_gradient


def update_activation_bytes(
    shape: dict,
    *,
    sequences: int,
    length: int,
    responses: int,
    element: int,
    autocast: bool = False,
    prompts: int | None = None,
) -> dict:
    """Bytes of activations an update's backward holds at its peak, with and without checkpointing, and what it
    still holds beside every gradient when it reaches the first layer (see the module docstring). ``autocast``: bf16
    autocast over float32 weights (``element`` 2), where the residual stream and the norms stay float32.
    ``prompts``: the distinct prompts run once each (``train.share_prompt``); ``None``: every sequence whole."""
    prompts = sequences if prompts is None else prompts
    # The positions the layers compute: each distinct prompt once, then every response (train.share_prompt).
    tokens = prompts * (length - responses) + sequences * responses
    # One decoder layer's saved tensors per token (counted with saved_tensors_hooks on Qwen2, sdpa): 8 h (the two
    # RMSNorms' inputs and normalised outputs, 4 h; q and the attention output, 2 h; the o_proj input copy and the
    # residual, 2 h), 2 kv (k and v after rotary, as sdpa keeps them: every row's whole keys and values, its shared
    # prompt's gathered in) and 4 m (gate, up, act(gate), act * up).
    per_layer = (tokens * (8 * shape["hidden"] + 4 * shape["mlp"]) + sequences * length * 2 * shape["kv"]) * element
    # Under autocast the same tensors are saved in bf16 (the linears' inputs as their bf16 casts), and the norms'
    # float32 inputs and outputs on top: 4 h more per token in float32 (counted the same way: 42 h of bf16 and 18 h
    # of float32 bytes per token at h 256, kv 128, m 768).
    norms = 4 * shape["hidden"] * 4 if autocast else 0
    per_layer += tokens * norms
    # A layer's backward holds its gradients beside those: about two [tokens, m] at once in the MLP's (the product's
    # gradient and the gate's or up's), the largest of the layer (measured 1.5-2 m per token).
    layer_backward = 2 * tokens * shape["mlp"] * element
    rows = sequences * responses  # response positions the head projects
    # Unchunked: logits, their float32 log-softmax and its exp (entropy); chunked: one chunk of each at a time; and
    # the response rows of the last hidden state, the head's input.
    head = 3 * head_chunk_logits(rows, shape["vocab"]) * 4 + rows * shape["hidden"] * element
    # Chunked within KEEP_ELEMENTS, the forward's float32 logits are all kept for the backward.
    if CHUNK_ELEMENTS < rows * shape["vocab"] <= KEEP_ELEMENTS:
        head += rows * shape["vocab"] * 4
    # Its input and normalised output, outside any layer (float32 under autocast, as the layers' norms).
    final_norm = 2 * tokens * shape["hidden"] * (4 if autocast else element)
    outside = head + final_norm
    # Without checkpointing the backward starts with every layer's tensors kept.
    without = shape["layers"] * per_layer + outside + layer_backward
    # Checkpointed: each layer keeps only its input [tokens, h]; the backward recomputes one layer at a time, holding
    # that layer's whole activations (per_layer) while it runs that layer's backward.
    # The residual stream, hence each layer's input, is float32 under autocast.
    kept_input = tokens * shape["hidden"] * (4 if autocast else element)
    with_checkpointing = shape["layers"] * kept_input + outside + per_layer + layer_backward
    return {
        "without_checkpointing": without,
        "with_checkpointing": with_checkpointing,
        # At the first layer, last in the backward, every gradient is written and this layer's activations (kept or
        # recomputed) and its backward's gradients are still held: the backward's other candidate for its peak.
        "last_layer": per_layer + layer_backward,
    }


def estimate(
    cfg,
    *,
    processes: int,
    prompt_tokens: int,
    eval_prompts: dict | None = None,
    responses_per_step: int | None = None,
    new_tokens=None,
) -> dict:
    """Every figure of the module docstring, in bytes, for one process (``cfg``: validated, :func:`compose_config`;
    ``eval_prompts``: :func:`eval_prompts_of`, ``None`` for no evaluation)."""
    from recipes.common.models import resolve_dtype
    from recipes.grpo.evaluation import eval_generation

    dtype = resolve_dtype(cfg.dtype)
    shards = processes if cfg.distributed.strategy == "fsdp" else 1
    lora = cfg.model.lora  # null, or on: settled as the command line says
    with_lora = lora is not None
    responses_per_step = responses_per_step or cfg.rollout.responses_per_step
    new_tokens = new_tokens or cfg.rollout.generation["max_new_tokens"]
    mixed = cfg.train.mixed_precision == "bf16"
    compute_element = 2 if mixed else torch.finfo(dtype).bits // 8

    policy = meta_model(cfg.model, kind="policy", dtype=dtype)
    shape = _shape(policy.config)
    params = parameter_bytes(policy)
    if with_lora:
        trainable_element = 4  # adapters in float32
        trainable_count, largest_trainable = lora_parameter_count(policy, lora)
        params += trainable_count * trainable_element
    else:
        trainable_count, trainable_element = sum(p.numel() for p in policy.parameters()), dtype.itemsize
        largest_trainable = max(p.numel() for p in policy.parameters())
    figures = {
        "parameters": params / shards,
        "gradients": trainable_count * trainable_element / shards,
        "optimizer": 2 * trainable_count * trainable_element / shards,  # AdamW: exp_avg, exp_avg_sq
        "autocast_weight_copies": (sum(p.numel() for p in policy.parameters()) * 2 / shards) if mixed else 0,
        "reference_model": parameter_bytes(policy) / shards if cfg.loss.kl_to_ref_coeff and not with_lora else 0,
        "reward_model": (
            parameter_bytes(meta_model(cfg.reward_model, kind="reward_model", dtype=dtype)) / shards
            if cfg.reward_model is not None  # reward_model=none: the reward functions alone score
            else 0
        ),
        "fsdp_gathered_weights": gathered_unit_bytes(policy) if shards > 1 else 0,
    }
    length = prompt_tokens + new_tokens
    sequences = min(cfg.train.mini_batch_size, responses_per_step)
    if cfg.train.max_tokens_per_micro_batch is not None:  # micro-batches of whole sequences within the budget
        sequences = min(sequences, max(1, cfg.train.max_tokens_per_micro_batch // length))
    # With train.share_prompt each distinct prompt runs once: at most one per group of the step in a (micro-)batch.
    groups = max(1, responses_per_step // cfg.rollout.group_size)
    prompts = min(sequences, groups) if cfg.train.share_prompt else sequences
    activations = update_activation_bytes(
        shape,
        sequences=sequences,
        length=length,
        responses=new_tokens,
        element=compute_element,
        autocast=mixed,
        prompts=prompts,
    )
    figures["activations_without_checkpointing"] = activations["without_checkpointing"]
    figures["activations_with_checkpointing"] = activations["with_checkpointing"]
    figures["activations_last_layer"] = activations["last_layer"]
    weight_element = dtype.itemsize
    figures["generation_kv_cache"] = 2 * shape["layers"] * shape["kv"] * responses_per_step * length * weight_element
    eval_sequences = eval_length = 0
    if eval_prompts is not None:  # one decoding loop of recipes.grpo.evaluation.Evaluator
        group = int(cfg.eval.group_size)
        eval_sequences = min(max(1, responses_per_step // group), eval_prompts["per_process"]) * group
        eval_length = eval_prompts["prompt_tokens"] + int(eval_generation(cfg)["max_new_tokens"])
    figures["eval_generation_kv_cache"] = (
        2 * shape["layers"] * shape["kv"] * eval_sequences * eval_length * weight_element
    )
    loops = [(responses_per_step, new_tokens)]  # each decoding loop's rows and tokens: the rollout's, the eval's
    if eval_prompts is not None:
        loops.append((eval_sequences, int(eval_generation(cfg)["max_new_tokens"])))
    figures["cpu_sampler_packed_head"] = max(
        sampler_packed_head_bytes(
            rows, shape["vocab"], shape["hidden"], element=weight_element, device=str(cfg.device), new_tokens=tokens
        )
        for rows, tokens in loops
    )
    scored = cfg.rollout.log_prob_micro_batch_size or responses_per_step
    one_layer = scored * length * (2 * shape["hidden"] + 2 * shape["kv"] + 2 * shape["mlp"]) * weight_element
    figures["reference_scoring"] = one_layer + head_chunk_logits(scored * new_tokens, shape["vocab"]) * 4 * 2
    figures["optimizer_step_temporaries"] = optimizer_step_temporaries(
        trainable_bytes=figures["gradients"],
        largest_bytes=largest_trainable * trainable_element / shards,
        foreach=torch.device(str(cfg.device)).type in ("cuda", "xpu"),
    )
    figures["cpu_scorer_buffers"] = 0
    figures["cpu_reference_scorer_buffers"] = 0
    if torch.device(str(cfg.device)).type == "cpu":
        head_gradient = shape["vocab"] * shape["hidden"] * trainable_element if not with_lora and processes == 1 else 0
        figures["cpu_scorer_buffers"] = scorer_buffers_held(
            max(sequences * new_tokens, scored * new_tokens), shape["vocab"], head_gradient=head_gradient
        )
        if figures["reference_model"] or with_lora and cfg.loss.kl_to_ref_coeff:
            figures["cpu_reference_scorer_buffers"] = scorer_buffers_held(scored * new_tokens, shape["vocab"])
    # What --measure compares with: the step on CPU, one parameter at a time.
    figures["largest_trainable_bytes"] = largest_trainable * trainable_element / shards
    persistent = sum(figures[key] for key in ("parameters", "optimizer", "reference_model", "reward_model"))
    figures["update_phase"] = update_phase(figures, checkpointing=cfg.train.gradient_checkpointing)
    # Units are gathered while a model runs: the policy's as it generates, the reference's (the same shapes) as it
    # scores; the update's backward counts its own.
    gathered = figures["fsdp_gathered_weights"]
    sampling = max(figures["generation_kv_cache"], figures["eval_generation_kv_cache"])
    sampling += figures["cpu_sampler_packed_head"]
    # On CPU the scorers' buffers stay through the phases around their calls (the update's own are in its figure).
    held, held_reference = figures["cpu_scorer_buffers"], figures["cpu_reference_scorer_buffers"]
    figures["peak"] = persistent + max(
        figures["update_phase"] + held_reference,
        held + held_reference + gathered + sampling,
        held + gathered + figures["reference_scoring"],
    )
    figures["setting"] = {
        "strategy": cfg.distributed.strategy,
        "processes": processes,
        "lora": with_lora,
        "device": str(cfg.device),
        "dtype": str(cfg.dtype),
        "mixed_precision": str(cfg.train.mixed_precision),
        "gradient_checkpointing": bool(cfg.train.gradient_checkpointing),
        "responses_per_step": responses_per_step,
        "mini_batch_size": cfg.train.mini_batch_size,
        "update_sequences": sequences,  # per forward: the mini-batch, or a token-budget micro-batch
        "distinct_prompts": prompts,
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": new_tokens,
        "eval_sequences": eval_sequences,
        "eval_tokens": eval_length,
        "trainable_parameters": trainable_count,
    }
    return figures


def update_phase(figures: dict, *, checkpointing: bool) -> float:
    """What an update adds to the persistent memory at its peak: the backward (activations still held while the
    gradients fill in) or the optimizer step (gradients and the step's temporaries), whichever is larger."""
    activations = figures["activations_with_checkpointing" if checkpointing else "activations_without_checkpointing"]
    # The gradients fill in as the backward frees the activations, layer by layer from the last: its peak is at its
    # start (the activations, few gradients yet) or at its end (every gradient, the first layer's activations).
    # Under fsdp the units running hold their gathered weights too; the optimizer step runs on the shards alone.
    backward = (
        figures["autocast_weight_copies"]
        + figures["fsdp_gathered_weights"]
        + max(activations, figures["gradients"] + figures["activations_last_layer"])
    )
    return max(backward, figures["gradients"] + figures["optimizer_step_temporaries"])


def largest_fitting(
    cfg, *, processes: int, prompt_tokens: int, device_memory: int, eval_prompts: dict | None = None
) -> list[dict]:
    """For the configured response length and 2x, 4x, 8x of it: the most responses per step (a multiple of the group
    size) whose estimated peak fits ``device_memory``; 0 when not even one group fits. The evaluation's answers keep
    their configured length."""
    group = cfg.rollout.group_size
    rows = []
    for factor in (1, 2, 4, 8):
        new_tokens = cfg.rollout.generation["max_new_tokens"] * factor

        def fits(groups: int, new_tokens=new_tokens) -> bool:
            figures = estimate(
                cfg,
                processes=processes,
                prompt_tokens=prompt_tokens,
                eval_prompts=eval_prompts,
                responses_per_step=groups * group,
                new_tokens=new_tokens,
            )
            return figures["peak"] <= device_memory

        low, high = 0, 1
        while high <= _SEARCH_CAP and fits(high):  # doubling, then bisection
            low, high = high, high * 2
        capped = high > _SEARCH_CAP  # every size tried fits: the answer is "at least", not a size
        while not capped and high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        rows.append({"max_new_tokens": new_tokens, "responses_per_step": low * group, "at_least": capped})
    return rows


_SEARCH_CAP = 2**20  # groups per step: past this the search stops and says "at least"


# glibc's mallopt parameter M_MMAP_THRESHOLD (malloc.h).
_M_MMAP_THRESHOLD = -3


def _return_freed_memory_to_the_system() -> bool:
    """Has glibc serve every allocation of 64 KiB or more with its own ``mmap`` (unmapped when freed), so that the
    resident size follows the bytes of live tensors. By default glibc raises this threshold to the size of each large
    block freed (up to 32 MiB), after which freed activations stay in its heap: the resident peak then counts every
    block an update has ever freed that the heap could not reuse (checkpointed backwards measured up to 2x their live
    tensors). A device allocator reuses such blocks, so that is not what the estimate models. False off glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024))
    except (OSError, AttributeError):
        return False


def _resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_update(cfg, *, prompt_tokens: int) -> int:
    """Peak memory added by one real update on the config's device: a forward of ``train.mini_batch_size`` random
    sequences through the recipe's log-prob scorer (in the recipe's update context), backward, AdamW step (which
    allocates the moments). On CPU the process's resident memory, sampled every millisecond from /proc; on CUDA the
    allocator's peak (``torch.cuda.max_memory_allocated``) over its level before the update. The policy is the
    recipe's (LoRA adapters with ``model.lora``); under ``torchrun`` it is wrapped as the recipe wraps it
    (``distributed.strategy``: DDP, or FSDP2 shards), and each process measures its own."""
    from hydra.utils import instantiate

    from recipes.grpo.log_probs import make_policy_scorer
    from recipes.grpo.policy import enable_activation_checkpointing, load_policy, trainable_parameters, update_forward

    _return_freed_memory_to_the_system()
    torch.manual_seed(0)
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None:  # under torchrun, each process its own GPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    policy = load_policy(cfg.model, device=device, dtype=cfg.dtype).eval()
    if cfg.train.gradient_checkpointing:
        enable_activation_checkpointing(policy)
    scorer = make_policy_scorer(
        policy, strategy=cfg.distributed.strategy, device=device, share_prompt=cfg.train.share_prompt
    )
    optimizer = instantiate(dataclasses.asdict(cfg.optimizer))(trainable_parameters(policy))
    new_tokens = cfg.rollout.generation["max_new_tokens"]
    vocab = policy.get_output_embeddings().weight.shape[0]
    sequences = min(cfg.train.mini_batch_size, cfg.rollout.responses_per_step)
    if cfg.train.max_tokens_per_micro_batch is not None:
        sequences = min(sequences, max(1, cfg.train.max_tokens_per_micro_batch // (prompt_tokens + new_tokens)))
    tokens = torch.randint(0, vocab, (sequences, prompt_tokens + new_tokens), device=device)
    # Groups of group_size rows share their prompt, as a step's batch does (train.share_prompt computes each once).
    group = torch.arange(sequences, device=device) // cfg.rollout.group_size
    tokens[:, :prompt_tokens] = tokens[group * cfg.rollout.group_size, :prompt_tokens]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    # A warm-up update on one short sequence first: the first backward and optimizer step initialise library state
    # (autograd threads, kernels, FSDP2's lazy set-up) that no estimate of the run's tensors should be compared with.
    # Then the gradients and AdamW moments are dropped, so the measured step allocates them again.
    with update_forward(policy, mixed_precision=cfg.train.mixed_precision, device=device):
        warm_up = scorer(tokens[:1, : prompt_tokens + 1], mask[:1, : prompt_tokens + 1], response_start=prompt_tokens)
    warm_up[0].sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()
    del warm_up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _one_update(policy, scorer, optimizer, tokens, mask, cfg=cfg, prompt_tokens=prompt_tokens, device=device)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - baseline
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _resident_bytes())
            time.sleep(0.001)

    baseline = _resident_bytes()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _one_update(policy, scorer, optimizer, tokens, mask, cfg=cfg, prompt_tokens=prompt_tokens, device=device)
    peak[0] = max(peak[0], _resident_bytes())
    done.set()
    sampler.join()
    return peak[0] - baseline


def _one_update(policy, scorer, optimizer, tokens, mask, *, cfg, prompt_tokens: int, device) -> None:
    """The measured update: forward through the scorer, backward, optimizer step."""
    from recipes.grpo.policy import update_forward

    with update_forward(policy, mixed_precision=cfg.train.mixed_precision, device=device):
        log_probs, _ = scorer(tokens, mask, response_start=prompt_tokens, with_entropy=True)
        loss = -log_probs.sum() / mask.sum()
    loss.backward()
    optimizer.step()


def report(figures: dict, fitting: list[dict] | None, device_memory: int | None) -> str:
    setting = figures["setting"]
    lines = [
        f"Per-device memory estimate ({setting['strategy']} over {setting['processes']} process(es), "
        f"dtype={setting['dtype']}, mixed_precision={setting['mixed_precision']}, "
        f"{'LoRA' if setting['lora'] else 'full fine-tuning'}: {setting['trainable_parameters']:,} trainable "
        f"parameters; {setting['responses_per_step']} responses per step in mini-batches of "
        f"{setting['mini_batch_size']} ({setting['update_sequences']} sequences and {setting['distinct_prompts']} "
        f"distinct prompts per forward), {setting['prompt_tokens']} prompt + {setting['max_new_tokens']} new tokens"
        + (
            f"; eval: {setting['eval_sequences']} answers of up to {setting['eval_tokens']} tokens at once)"
            if setting["eval_sequences"]
            else ")"
        ),
    ]
    names = [
        ("parameters", "parameters"),
        ("gradients", "gradients"),
        ("optimizer", "optimizer state (AdamW, 2 moments)"),
        ("autocast_weight_copies", "autocast bf16 weight copies"),
        ("reference_model", "reference model"),
        ("reward_model", "reward model"),
        ("fsdp_gathered_weights", "fsdp gathered units (root + 2 layers)"),
        ("activations_without_checkpointing", "update activations, no checkpointing"),
        ("activations_with_checkpointing", "update activations, gradient checkpointing"),
        ("generation_kv_cache", "generation KV cache"),
        ("eval_generation_kv_cache", "eval generation KV cache"),
        ("reference_scoring", "reference scoring (no grad)"),
        ("cpu_sampler_packed_head", "sampler's packed head weight on CPU"),
        ("cpu_scorer_buffers", "policy scorer's buffers kept on CPU"),
        ("cpu_reference_scorer_buffers", "reference scorer's buffers kept on CPU"),
        ("optimizer_step_temporaries", "optimizer step temporaries"),
        ("update_phase", "update (backward or optimizer step)"),
        ("peak", f"peak (gradient_checkpointing={str(setting['gradient_checkpointing']).lower()})"),
    ]
    lines += [f"  {label:<45} {human(figures[key]):>12}" for key, label in names]
    if fitting is not None:
        lines.append(f"Fits in {human(device_memory)} (responses per step, multiples of the group size):")
        lines += [
            f"  max_new_tokens={row['max_new_tokens']:<6} responses_per_step "
            + (
                f">= {row['responses_per_step']} (every size up to the search's cap fits)"
                if row["at_least"]
                else f"<= {row['responses_per_step']}"
            )
            for row in fitting
        ]
    if "measured_update" in figures:
        estimated = figures["measured_estimate"]
        lines.append(
            f"Measured one update on {setting['device']} (AdamW's first step): +{human(figures['measured_update'])}; "
            f"estimated: {human(estimated)} (measured / estimated {figures['measured_update'] / estimated:.2f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="recipe config overrides, e.g. model.name_or_path=<folder>")
    parser.add_argument(
        "--processes", type=int, default=1, help="processes (devices) of the run; fsdp shards over them"
    )
    parser.add_argument("--device-memory", type=parse_size, default=None, help="e.g. 80GiB: what fits in it")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="prompt width (training and eval); default: the longest rendered training (eval) prompt",
    )
    parser.add_argument(
        "--measure", action="store_true", help="also run one update on the config's device and measure it"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error(f"--processes {args.processes}: must be >= 1.")
    launched = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: its processes measure, one each
    if args.measure and launched > 1:
        if args.processes not in (1, launched):
            parser.error(f"--processes {args.processes} under torchrun with {launched} processes: drop --processes.")
        args.processes = launched
        from accelerate import PartialState

        PartialState(cpu=True)  # the launcher's processes join one group (gloo), as the recipe's CPU processes do

    from recipes.grpo.schema import TRL_NAMES, GRPORecipeConfig

    # A key without + that the recipe lacks: its key named (trl's num_generations is rollout.group_size), not Hydra's.
    refuse_unknown_overrides(args.overrides, GRPORecipeConfig, recipe="grpo_torchrl_rm", aliases=TRL_NAMES)
    try:
        cfg = compose_config(args.overrides)
    except ConfigError as error:
        raise SystemExit(f"estimate_memory: the recipe refuses this config: {error}") from None
    prompt_tokens = args.prompt_tokens or prompt_tokens_of(cfg)
    eval_prompts = eval_prompts_of(cfg, processes=args.processes, prompt_tokens=args.prompt_tokens)
    figures = estimate(cfg, processes=args.processes, prompt_tokens=prompt_tokens, eval_prompts=eval_prompts)
    fitting = None
    if args.device_memory is not None:
        fitting = largest_fitting(
            cfg,
            processes=args.processes,
            prompt_tokens=prompt_tokens,
            device_memory=args.device_memory,
            eval_prompts=eval_prompts,
        )
        figures["fitting"] = fitting
    main_process = True
    if args.measure:
        figures["measured_update"] = measure_update(cfg, prompt_tokens=prompt_tokens)
        if launched > 1:  # every process measured its own: report the largest
            from accelerate import PartialState
            from accelerate.utils import gather_object

            figures["measured_update"] = max(gather_object([figures["measured_update"]]))
            main_process = PartialState().is_main_process
        # The measured step is AdamW's first: its moments are allocated in the step, not held from before.
        temporaries = optimizer_step_temporaries(
            trainable_bytes=figures["gradients"], largest_bytes=figures["largest_trainable_bytes"], foreach=False
        )
        step = dict(figures, optimizer_step_temporaries=figures["optimizer"] + temporaries)
        figures["measured_estimate"] = update_phase(step, checkpointing=cfg.train.gradient_checkpointing)
    if main_process:
        print(report(figures, fitting, args.device_memory))
        if args.json is not None:
            args.json.write_text(json.dumps(figures, indent=2))
    if args.measure and launched > 1:
        from accelerate import PartialState

        # Leave the process group before the interpreter exits: a gloo thread still alive at exit aborted a rank
        # now and then ("terminate called without an active exception", exit -6), as the recipes' run.finish avoids.
        PartialState().destroy_process_group()
    return figures


if __name__ == "__main__":
    main()
