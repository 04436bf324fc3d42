"""GRPO speed: ``recipes/grpo_torchrl_rm.py`` (TorchRL components), sync and async, against ``trl.GRPOTrainer``.

    python scripts/bench_grpo.py                     # recipe defaults (G=8, 64 responses x 32 tokens), 5 rounds of 10
    python scripts/bench_grpo.py --quick             # tiny smoke configuration (about a minute on 2 cores)
    python scripts/bench_grpo.py --rounds 7 --steps 8 --updates-per-step 2 rollout.generation.max_new_tokens=48
    # a real vocabulary (~97M parameters, V = 151,936; a speed model, built offline in about half a minute):
    python scripts/build_tiny_models.py --out /tmp/real_vocab --hidden-size 512 --num-layers 6 --pretrain-steps 20 \\
        --resize-vocab 151936
    python scripts/bench_grpo.py --rounds 2 --steps 3 --sync-threads 2 --async-target 1.2 --memory \\
        model.name_or_path=/tmp/real_vocab/policy reward_model.name_or_path=/tmp/real_vocab/reward_base

Every side runs the same job, read from ONE composed recipe config (``conf/grpo_torchrl_rm.yaml`` plus the overrides
given on the command line): the same policy (``model.name_or_path``), reward model (``reward_model.name_or_path``,
an ``AutoModelForSequenceClassification``), prompts (``data=``; the synthetic task's by default, conversational
``[{"role": "user", ...}]`` prompts for trl), group size, responses per generation batch, maximum new tokens,
sampling (temperature, top-k, top-p), the algorithm (``loss.type`` = trl's ``loss_type``, dapo by default; the clip
range = ``epsilon``/``epsilon_high``; ``loss.kl_to_ref_coeff`` = trl's ``beta``, both with a frozen reference model;
``advantage.scale_rewards``...; ``--loss-type`` runs the bench for another type), AdamW settings, gradient clipping,
the learning-rate schedule and float32.

- ours (sync) and ours (async): the recipe's own ``train(cfg)`` with ``rollout.mode=sync|async`` (composed with Hydra,
  no intermediate checkpoints), timed by the recipe itself: ``summary.json``'s ``perf/wall_time_s`` (the training steps,
  setup apart) and ``generated_tokens``; its ``metrics.csv`` gives the phases. Ours (sync) runs with 1 torch thread,
  and with 2 sampling on 1 (the recipe's ``num_threads`` and ``rollout.learner_sampling_threads``; ``--sync-threads``),
  and the faster is "ours (sync)" in the ratios, as for trl; ours (async) with ``num_threads`` (1) in the learner and
  ``rollout.collector_threads`` (1) in the collector process, one core each.
- trl: ``GRPOTrainer`` with ``per_device_train_batch_size`` = responses per optimizer step, ``num_generations`` =
  group size, ``steps_per_generation`` = optimizer steps per generation batch, ``num_iterations`` = the recipe's
  ``train.epochs_per_step``, ``gradient_accumulation_steps=1``, timed from ``on_train_begin`` to the last
  ``on_step_end``; its generated tokens are its completion masks summed (completion tokens up to and including EOS,
  as the recipe counts them). It runs with 1 and with 2 torch threads (``--trl-threads``); the faster (median
  tokens/s) is "trl" in the ratios.

Every response is ``max_new_tokens`` long on every side by default (``min_new_tokens`` = ``max_new_tokens``): all then
do the same work, and the tokens per second compare speed rather than how long the responses of differently seeded
runs happen to grow (``--natural-length`` lets them end at EOS). One optimizer step per generation batch by default
(``--updates-per-step 1``). Rounds rotate the order of the sides with fresh models every run, so machine load hits all
alike; round 0 warms up imports and caches and is not counted. A run is 10 generation batches by default (the
recipe's default run has 30): the async mode's first step cannot overlap anything, and counts as one in ten. Figures
are medians over rounds: generated tokens per second of training (generation, scoring and updates together), seconds
per optimizer step, tokens per second of the rollout phase (ours: generation, reward, advantages, reference
log-probs; trl: ``_generate_and_score_completions``), and seconds per generation batch in each phase: generate,
reward, reference log-probs, advantage, update, and everything else (async: the learner's wait for the collector; its
generation and reward run meanwhile in the other process). ``--memory`` then runs the compared sides once more, each
in a fresh process, and reports the peak resident memory during the update and over the whole run. Targets: ours
(sync) >= 1.0x trl, ours (async) >= ``--async-target`` (1.5x on the tiny models, 1.2x at a real vocabulary).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Nothing is downloaded: every model and tokenizer loads from a local folder.
for _name, _value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
    os.environ.setdefault(_name, _value)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

QUICK_OVERRIDES = [
    "rollout.group_size=4",
    "rollout.responses_per_step=8",
    "rollout.generation.max_new_tokens=8",
]
PHASES = ("generate", "reward", "reference", "advantage", "update", "other")
ASYNC = "ours (async)"
ASYNC_BF16 = "ours (async, bf16)"  # --sampler-dtype bfloat16: the collector samples on a bf16 copy


def _threads(count: int) -> str:
    return f"{count} thread{'s' if count > 1 else ''}"


@dataclass
class Run:
    """One side's figures for one round."""

    tokens: int  # generated completion tokens, EOS included
    seconds: float  # the training steps' wall time, setup apart
    optimizer_steps: int
    generation_batches: int
    rollout_seconds: float  # of which the rollout phase (generate, score, log-probs)
    responses: int
    phases: dict[str, float] = field(default_factory=dict)  # seconds per generation batch

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def s_per_step(self) -> float:
        return self.seconds / self.optimizer_steps

    @property
    def rollout_tokens_per_s(self) -> float:
        return self.tokens / self.rollout_seconds

    @property
    def tokens_per_response(self) -> float:
        return self.tokens / self.responses


def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    import recipes.common.config  # noqa: F401  (registers ${project_root:})

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("grpo_torchrl_rm", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def run_ours(cfg) -> Run:
    import recipes.grpo_torchrl_rm as recipe

    summary = recipe.train(cfg)
    updates = cfg.train.epochs_per_step * (cfg.rollout.responses_per_step // cfg.train.mini_batch_size)
    with open(Path(cfg.output_dir) / "metrics.csv", newline="") as handle:
        rows = [{key: float(value) for key, value in row.items()} for row in csv.DictReader(handle)]
    phases = {
        "generate": "perf/generate_s",
        "reward": "perf/reward_s",
        "reference": "perf/reference_s",
        "advantage": "perf/advantage_s",
        "update": "perf/update_s",
    }
    per_step = {phase: statistics.mean(row[key] for row in rows) for phase, key in phases.items()}
    step_time = statistics.mean(row["perf/step_time_s"] for row in rows)
    # Async: generation and reward run in the collector process while the learner updates, so the learner's step is
    # its preparation of the batch, the update and the rest ("other": mostly its wait for the next batch).
    learner = ("reference", "advantage", "update") if cfg.rollout.mode == "async" else tuple(per_step)
    per_step["other"] = step_time - sum(per_step[phase] for phase in learner)
    per_step["total"] = step_time
    return Run(
        tokens=int(summary["rollout/generated_tokens"]),
        seconds=summary["perf/wall_time_s"],
        optimizer_steps=summary["train/steps"] * updates,
        generation_batches=summary["train/steps"],
        # The recipe reports rollout throughput, tokens / rollout seconds: invert it for the rollout time.
        rollout_seconds=summary["rollout/generated_tokens"] / summary["perf/tokens_per_s"],
        responses=summary["train/steps"] * cfg.rollout.responses_per_step,
        phases=per_step,
    )


# rollout.generation's settings that are GRPOConfig fields of the same name (max_new_tokens is its
# max_completion_length; do_sample has no field: trl always samples).
_GRPO_CONFIG_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def extra_generation_kwargs(cfg) -> dict:
    """Generation settings of the recipe config that ``GRPOConfig`` has no field for (``min_new_tokens``...)."""
    known = {"max_new_tokens", "do_sample", *_GRPO_CONFIG_SAMPLING}
    return {str(k): v for k, v in cfg.rollout.generation.items() if k not in known}


def sampling_fields(cfg) -> dict:
    """The ``GRPOConfig`` sampling fields the recipe config sets; the others keep trl's own defaults. trl reads
    ``top_k=0`` as off, the recipe's sampler ``null``."""
    generation = cfg.rollout.generation
    fields = {name: generation[name] for name in _GRPO_CONFIG_SAMPLING if name in generation}
    if "top_k" in fields:
        fields["top_k"] = fields["top_k"] or 0
    return fields


def make_trl_config(cfg, *, output_dir: str):
    """``GRPOConfig`` doing what the recipe config ``cfg`` does, step for step."""
    from trl import GRPOConfig

    from recipes.common.schema import typed_config
    from recipes.grpo.schema import Loss

    per_step, mini = cfg.rollout.responses_per_step, cfg.train.mini_batch_size
    accumulation = cfg.train.gradient_accumulation_steps
    micro_batches_per_generation = per_step // mini  # trl's steps_per_generation counts micro-batches
    generation = cfg.rollout.generation
    loss = typed_config(cfg.loss, Loss, key="loss")
    if not generation.do_sample:
        raise ValueError("bench_grpo: rollout.generation.do_sample=false; trl's GRPOTrainer always samples.")
    betas = list(cfg.optimizer.betas)
    return GRPOConfig(
        output_dir=output_dir,
        seed=cfg.seed,
        use_cpu=str(cfg.device) == "cpu",
        bf16=False,
        fp16=False,
        activation_checkpointing=False,  # trl turns it on by default; the recipe does not recompute activations
        disable_dropout=True,  # the recipe runs the policy in eval() mode
        per_device_train_batch_size=mini,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=micro_batches_per_generation,
        num_iterations=cfg.train.epochs_per_step,
        num_generations=cfg.rollout.group_size,
        max_completion_length=generation.max_new_tokens,
        # trl's own generation applies its sampler correction only to vLLM completions, never here; TorchRL's side
        # would pay a forward pass for it (trl's default is on): off, both sides do the same work.
        vllm_importance_sampling_correction=False,
        **sampling_fields(cfg),
        generation_kwargs=extra_generation_kwargs(cfg) or None,
        max_steps=cfg.train.steps * micro_batches_per_generation // accumulation * cfg.train.epochs_per_step,
        learning_rate=cfg.optimizer.lr,
        lr_scheduler_type=cfg.train.lr_scheduler,
        warmup_steps=cfg.train.warmup_steps,
        optim="adamw_torch_fused" if cfg.optimizer.fused else "adamw_torch",  # the recipe's AdamW, fused or not
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        weight_decay=cfg.optimizer.weight_decay,
        max_grad_norm=cfg.train.max_grad_norm,
        # The recipe's algorithm, in trl's names: the two sides always run the same one.
        beta=loss.kl_to_ref_coeff or 0.0,  # the recipe's null: no KL term, trl's 0
        epsilon=loss.clip_epsilon,
        epsilon_high=loss.clip_epsilon_high,
        delta=loss.delta,
        entropy_coef=loss.entropy_coeff,
        loss_type=loss.type,
        importance_sampling_level=loss.importance_sampling_level,
        use_bias_correction_kl=loss.kl_bias_correction,
        top_entropy_quantile=loss.top_entropy_quantile,
        mask_truncated_completions=loss.mask_truncated_completions,
        off_policy_mask_threshold=loss.off_policy_mask_threshold,
        scale_rewards=cfg.advantage.scale_rewards,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


class _Clock:
    """Seconds spent per phase, with nesting: time inside an inner phase is not counted in the outer one."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[tuple[str, float]] = []
        self.on_phase = None  # called with the phase entered (or returned to), for the memory sampler

    def __call__(self, phase: str, function, *args, **kwargs):
        now = time.perf_counter()
        if self._stack:
            outer, since = self._stack[-1]
            self.seconds[outer] = self.seconds.get(outer, 0.0) + now - since
        self._stack.append((phase, now))
        if self.on_phase:
            self.on_phase(phase)
        try:
            return function(*args, **kwargs)
        finally:
            end = time.perf_counter()
            _, since = self._stack.pop()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + end - since
            if self._stack:
                self._stack[-1] = (self._stack[-1][0], end)
                if self.on_phase:
                    self.on_phase(self._stack[-1][0])
            elif self.on_phase:
                self.on_phase("other")


def run_trl(
    cfg, *, output_dir: str, threads: int, on_phase=None, torchrl_rollouts: bool | str = False, stream: bool = False
) -> Run:
    """trl's ``GRPOTrainer`` on ``cfg``'s job, timed by phase. ``torchrl_rollouts``: its completions come from the
    library's TorchRL sampler through ``interop.TorchRLRolloutFunc`` (trl's ``rollout_func``), sampling with the
    model trl trains at the ``GRPOConfig``'s settings (``True`` or ``"sync"``), or one generation batch ahead in a
    child process (``"async"``, under ``interop.TorchRLGRPOTrainer``); everything else is trl's, unchanged.
    ``stream``: the prompts come from a TorchRL buffer as a stream trl does not shuffle (what the async mode reads
    ahead), the same order for every side that takes it."""
    import datasets
    import torch
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from interop.trl.trainer import TorchRLGRPOTrainer
    from recipes.common.data import load_prompts
    from recipes.common.models import load_causal_lm, load_reward_model, load_tokenizer

    clock = _Clock()
    clock.on_phase = on_phase

    mode = {True: "sync", False: None}.get(torchrl_rollouts, torchrl_rollouts)
    base = TorchRLGRPOTrainer if mode == "async" else GRPOTrainer

    class TimedGRPOTrainer(base):
        """Counts the generated tokens and times each phase; trains exactly as its base trainer."""

        generated_tokens = 0
        generated_responses = 0

        def training_step(self, *args, **kwargs):
            return clock("update", super().training_step, *args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            output = clock("advantage", super()._generate_and_score_completions, inputs)
            self.generated_tokens += int(output["completion_mask"].sum())
            self.generated_responses += output["completion_mask"].shape[0]
            return output

        def _generate(self, prompts):
            return clock("generate", super()._generate, prompts)

        def _calculate_rewards(self, *args, **kwargs):
            return clock("reward", super()._calculate_rewards, *args, **kwargs)

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            # Inside the scoring of a generation batch: the reference (or old) log-probs; inside the loss: the update.
            scoring = clock._stack and clock._stack[-1][0] == "advantage"
            function = super()._get_per_token_logps_and_entropies
            return clock("reference", function, model, *args, **kwargs) if scoring else function(model, *args, **kwargs)

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = self.end = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.end = time.perf_counter()

    torch.set_num_threads(threads)
    system = [{"role": "system", "content": cfg.rollout.system_prompt}] if cfg.rollout.system_prompt else []
    prompts = [
        system + ([{"role": "user", "content": p}] if isinstance(p, str) else list(p))
        for p in load_prompts(cfg.data, "train")
    ]
    tokenizer = load_tokenizer(cfg.model, padding_side="left")
    reward_tokenizer = load_tokenizer(cfg.reward_model, padding_side="right")
    policy = load_causal_lm(cfg.model, device=cfg.device, dtype=cfg.dtype)
    reward_model = load_reward_model(
        cfg.reward_model, device=cfg.device, dtype=cfg.dtype, pad_token_id=reward_tokenizer.pad_token_id
    ).eval()
    rollout_func = None
    if mode is not None:
        from interop import TorchRLRolloutFunc

        # The library's default: a CausalLMSampler around the trained model at the GRPOConfig's settings.
        # rollout.sampler_dtype other than dtype (async: apart from the learner): the child samples on a cast copy.
        sampler_dtype = None if cfg.rollout.sampler_dtype == cfg.dtype else getattr(torch, cfg.rollout.sampler_dtype)
        rollout_func = TorchRLRolloutFunc(tokenizer=tokenizer, mode=mode, seed=cfg.seed, sampler_dtype=sampler_dtype)
    args = make_trl_config(cfg, output_dir=output_dir)
    if stream:
        from recipes.common.prompts import PromptTable, make_prompt_stream

        table = PromptTable(prompts, tokenizer=tokenizer)
        per_draw = cfg.rollout.responses_per_step // cfg.rollout.group_size
        train_dataset = make_prompt_stream(table, batch_size=per_draw, seed=cfg.seed)
        args.shuffle_dataset = False  # the TorchRL buffer's sampler shuffles; the async mode reads the order ahead
    else:
        train_dataset = datasets.Dataset.from_dict({"prompt": prompts})
    torch.manual_seed(cfg.seed)
    step_clock = StepClock()
    trainer = TimedGRPOTrainer(
        model=policy,
        reward_funcs=reward_model,
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        reward_processing_classes=reward_tokenizer,
        callbacks=[step_clock],
        rollout_func=rollout_func,
    )
    trainer.remove_callback(PrinterCallback)  # keep the output to the measurements
    trainer.train()
    steps = trainer.state.global_step
    if steps != trainer.args.max_steps:
        raise RuntimeError(f"bench_grpo: trl ran {steps} optimizer steps, expected {trainer.args.max_steps}.")
    seconds = step_clock.end - step_clock.begin
    batches = cfg.train.steps
    phases = {phase: clock.seconds.get(phase, 0.0) / batches for phase in PHASES if phase != "other"}
    phases["other"] = seconds / batches - sum(phases.values())
    phases["total"] = seconds / batches
    rollout = sum(clock.seconds.get(phase, 0.0) for phase in ("generate", "reward", "reference", "advantage"))
    return Run(
        tokens=trainer.generated_tokens,
        seconds=seconds,
        optimizer_steps=steps,
        generation_batches=batches,
        rollout_seconds=rollout,
        responses=trainer.generated_responses,
        phases=phases,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration: " + " ".join(QUICK_OVERRIDES))
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds after the warm-up (default 5; quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="generation batches per run (default 10; quick 3)")
    parser.add_argument(
        "--updates-per-step",
        type=int,
        default=1,
        help="optimizer steps per generation batch, on every side (the recipe's own default is 2)",
    )
    parser.add_argument(
        "--natural-length",
        action="store_true",
        help="let responses end at EOS (default: every response is max_new_tokens long on every side, so that all "
        "do the same work whatever their runs learn)",
    )
    parser.add_argument(
        "--trl-threads", default="1,2", help="torch thread counts trl runs with; the fastest is compared (default 1,2)"
    )
    parser.add_argument(
        "--sync-threads",
        default="1,2/1",
        help="torch threads ours (sync) runs with (the recipe's num_threads), N/M: N, sampling on M "
        "(rollout.learner_sampling_threads); the fastest is compared (default 1,2/1: the tiny models decode fastest on "
        "one thread and train fastest on two)",
    )
    parser.add_argument(
        "--loss-type", default=None, help="loss.type for every side (trl's loss_type; default: the recipe's, dapo)"
    )
    parser.add_argument("--sync-target", type=float, default=1.0, help="the ratio ours (sync) / trl to reach")
    parser.add_argument("--async-target", type=float, default=1.5, help="the ratio ours (async) / trl to reach")
    parser.add_argument(
        "--sampler-dtype",
        choices=("bfloat16",),
        default=None,
        help="also run ours (async) with rollout.sampler_dtype=bfloat16 (the collector samples on a bf16 copy, cast "
        "at each push; the learner stays in dtype), in the same rounds: its generation phase and step against ours "
        "(async) in float32",
    )
    parser.add_argument(
        "--memory", action="store_true", help="then measure each side's peak memory, each in a fresh process"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the medians and ratios to this JSON file")
    parser.add_argument("--memory-side", default=None, help=argparse.SUPPRESS)  # internal: one side, in this process
    parser.add_argument(
        "overrides", nargs="*", help="recipe config overrides for every side, e.g. rollout.group_size=4"
    )
    args = parser.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 10)
    args.trl_threads = [int(n) for n in args.trl_threads.split(",")]
    malformed = "--sync-threads: each entry is N (threads) or N/M (N threads, sampling on M), e.g. 1,2/1"
    try:
        args.sync_threads = [tuple(int(n) for n in entry.split("/")) for entry in args.sync_threads.split(",")]
    except ValueError:
        parser.error(malformed)
    if any(len(entry) not in (1, 2) for entry in args.sync_threads):
        parser.error(malformed)
    counts = args.trl_threads + [n for entry in args.sync_threads for n in entry]
    if args.rounds < 1 or args.steps < 1 or args.updates_per_step < 1 or min(counts) < 1:
        parser.error("--rounds, --steps, --updates-per-step, --sync-threads and --trl-threads must be >= 1")
    return args


def _setup_process() -> None:
    import datasets
    from tensordict import set_list_to_stack
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    set_list_to_stack(True).set()
    # TorchRL 0.14.1's own internals raise these (the recipe's main() silences them too); trl warns about CPU runs.
    warnings.filterwarnings("ignore", message="size_average and reduce args will be deprecated")
    warnings.filterwarnings("ignore", message="The env passed to LLMCollector is missing transforms")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _config_for(args, side: str, run_index: int, scratch: Path):
    out = scratch / f"{run_index}-{re.sub(r'[^a-z0-9]+', '_', side).strip('_')}"
    overrides = [*QUICK_OVERRIDES] if args.quick else []
    overrides += [
        f"output_dir={out}",
        f"hydra.run.dir={out}",
        "logger=csv",
        "progress_bar=false",
        "checkpoint.every_n_steps=null",
        "checkpoint.keep_last=1",
        f"train.steps={args.steps}",
        f"seed={run_index}",
        f"rollout.mode={'async' if side in (ASYNC, ASYNC_BF16) else 'sync'}",
        *([f"rollout.sampler_dtype={args.sampler_dtype}"] if side == ASYNC_BF16 else []),
        *([f"loss.type={args.loss_type}"] if args.loss_type else []),
        *args.overrides,
    ]
    if side.startswith("ours (sync"):
        overrides.append(f"num_threads={_thread_count(side)}")
        sampling = re.search(r"sampling on (\d+)\)", side)
        if sampling:
            overrides.append(f"rollout.learner_sampling_threads={sampling.group(1)}")
    # After the user's overrides, so that the mini-batch follows a group size or batch given there.
    cfg = compose_config(overrides)
    per_step = cfg.rollout.responses_per_step
    if per_step % args.updates_per_step:
        raise SystemExit(
            f"bench_grpo: --updates-per-step {args.updates_per_step} does not divide rollout.responses_per_step="
            f"{per_step}."
        )
    overrides.append(f"train.mini_batch_size={per_step // args.updates_per_step}")
    if not args.natural_length:
        # Every response max_new_tokens long on every side: the same work, whatever the runs learn.
        overrides.append(f"rollout.generation.min_new_tokens={cfg.rollout.generation.max_new_tokens}")
    return compose_config(overrides)


def _thread_count(side: str) -> int:
    """The thread count in a side's name: ``"trl (2 threads)"`` -> 2, ``"ours (sync, 2 threads, sampling on 1)"``
    -> 2."""
    return int(re.search(r"(\d+) threads?[,)]", side).group(1))


def _run_side(args, side: str, run_index: int, scratch: Path, on_phase=None) -> Run:
    cfg = _config_for(args, side, run_index, scratch)
    gc.collect()
    if side.startswith("ours"):
        if on_phase is not None:
            import recipes.grpo_torchrl_rm as recipe

            optimize = recipe.optimize

            def marked(*a, **k):
                on_phase("update")
                try:
                    return optimize(*a, **k)
                finally:
                    on_phase("other")

            recipe.optimize = marked
        run = run_ours(cfg)
        # The run's final checkpoint (model and optimizer state: 1.1 GB at the real vocabulary) is never read here; the
        # run folder keeps its metrics.csv for scripts/plot_run.py. Kept, a bench of 7 runs left 6.5 GB in /tmp.
        shutil.rmtree(Path(cfg.output_dir) / "checkpoints", ignore_errors=True)
        return run
    return run_trl(cfg, output_dir=str(cfg.output_dir), threads=_thread_count(side), on_phase=on_phase)


def _measure_memory(args, side: str, scratch: Path) -> dict[str, float]:
    """Runs ``side`` here with a sampler of its resident memory: the peaks in MB, during the update and in all."""
    import psutil

    process = psutil.Process()
    peaks = {"update": 0.0, "all": 0.0}
    phase = ["other"]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss = process.memory_info().rss / 2**20
            peaks["all"] = max(peaks["all"], rss)
            if phase[0] == "update":
                peaks["update"] = max(peaks["update"], rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _run_side(args, side, 1, scratch, on_phase=lambda name: phase.__setitem__(0, name))
    finally:
        done.set()
        sampler.join()
    return peaks


def _memory_report(args, sides: list[str]) -> dict[str, dict[str, float]]:
    print("\npeak resident memory (MB), each side in a fresh process for", args.steps, "steps:")
    names = max(18, *map(len, sides))
    print(f"{'side':{names}s} {'update':>10s} {'whole run':>10s}")
    peaks = {}
    for side in sides:
        command = [sys.executable, __file__, "--memory-side", side, f"--steps={args.steps}"]
        command += ["--quick"] if args.quick else []
        command += ["--natural-length"] if args.natural_length else []
        command += [f"--updates-per-step={args.updates_per_step}", *args.overrides]
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
        if result.returncode != 0:
            raise RuntimeError(f"bench_grpo: the memory run of {side} failed:\n{result.stderr[-3000:]}")
        peaks[side] = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"{side:{names}s} {peaks[side]['update']:10.0f} {peaks[side]['all']:10.0f}", flush=True)
    print("  (ours (async): the learner's process; its collector process holds the sampling copy and reward model)")
    return peaks


def main(argv: list[str] | None = None) -> dict[str, list[Run]]:
    args = parse_args(argv)
    _setup_process()

    scratch = Path(tempfile.mkdtemp(prefix="bench_grpo."))
    if args.memory_side:
        print(json.dumps(_measure_memory(args, args.memory_side, scratch)))
        return {}

    sync_sides = [
        f"ours (sync, {_threads(entry[0])}{f', sampling on {entry[1]}' if len(entry) > 1 else ''})"
        for entry in args.sync_threads
    ]
    trl_sides = [f"trl ({_threads(n)})" for n in args.trl_threads]
    sides = [*sync_sides, ASYNC, *([ASYNC_BF16] if args.sampler_dtype else []), *trl_sides]
    cfg = _config_for(args, sync_sides[0], 0, scratch)
    async_cfg = _config_for(args, ASYNC, 0, scratch)
    if cfg.reward_model is None:
        raise SystemExit(
            "bench_grpo.py times both sides with the same reward model (trl's reward_funcs=[model]); "
            "reward_model=none leaves trl nothing to score with. Keep a reward_model (the default, tiny, or "
            "reward_model.name_or_path=...)."
        )
    print(
        f"GRPO, ours (recipes/grpo_torchrl_rm.py) vs trl {__import__('trl').__version__} GRPOTrainer, "
        f"{'quick, ' if args.quick else ''}{args.rounds} rounds (+1 warm-up) of {args.steps} generation batches each\n"
        f"  policy {cfg.model.name_or_path}, reward model {cfg.reward_model.name_or_path}, data={cfg.data.source}\n"
        f"  group {cfg.rollout.group_size}, {cfg.rollout.responses_per_step} responses per generation batch, "
        f"{args.updates_per_step} optimizer step(s) of {cfg.train.mini_batch_size} per batch, max_new_tokens "
        f"{cfg.rollout.generation.max_new_tokens}, temperature {cfg.rollout.generation.temperature}, top_k "
        f"{cfg.rollout.generation.top_k}, top_p {cfg.rollout.generation.top_p}, "
        f"{'responses end at EOS' if args.natural_length else 'every response max_new_tokens long'}\n"
        f"  loss_type {cfg.loss.type}, KL coefficient (trl beta) {cfg.loss.kl_to_ref_coeff}, clip "
        f"{cfg.loss.clip_epsilon}/{cfg.loss.clip_epsilon_high}, lr "
        f"{cfg.optimizer.lr}, {cfg.device} {cfg.dtype}; torch threads: ours (sync) "
        f"{' and '.join('/'.join(map(str, entry)) for entry in args.sync_threads)} (N/M: sampling on M), ours (async) "
        f"{async_cfg.num_threads} + a collector process of "
        f"{async_cfg.rollout.collector_threads}, trl {' and '.join(map(str, args.trl_threads))}",
        flush=True,
    )

    results: dict[str, list[Run]] = {side: [] for side in sides}
    names = max(24, *map(len, sides))  # the width of the side names' column
    for round_index in range(args.rounds + 1):
        # Rotate who goes first, so that a drift in the machine's load does not favour one side.
        shift = round_index % len(sides)
        for side in sides[shift:] + sides[:shift]:
            run = _run_side(args, side, round_index, scratch)
            label = "warm-up" if round_index == 0 else f"round {round_index}"
            print(
                f"  {label:8s} {side:{names}s} {run.tokens_per_s:9.1f} tokens/s {run.s_per_step:8.3f} s/step "
                f"{run.rollout_tokens_per_s:9.1f} rollout tokens/s ({run.tokens} tokens, {run.optimizer_steps} steps)",
                flush=True,
            )
            if round_index > 0:
                results[side].append(run)

    def median(side: str, name: str) -> float:
        return statistics.median(getattr(run, name) for run in results[side])

    def fastest(candidates: list[str]) -> str:
        return max(candidates, key=lambda side: median(side, "tokens_per_s"))

    # Each of ours (sync) and trl at its faster thread count; "ours (sync)" and "trl" below name those.
    best_sync, best_trl = fastest(sync_sides), fastest(trl_sides)
    compared = {"ours (sync)": best_sync, "ours (async)": ASYNC}
    columns = {
        "tokens_per_s": ("tokens/s", "{:10.1f}"),
        "s_per_step": ("s/step", "{:10.4f}"),
        "rollout_tokens_per_s": ("rollout tokens/s", "{:17.1f}"),
        "tokens_per_response": ("tokens/response", "{:16.1f}"),
    }
    widths = [len(fmt.format(0)) for _, fmt in columns.values()]
    print(f"\n{'median over rounds':{names}s} " + " ".join(f"{t:>{w}s}" for (t, _), w in zip(columns.values(), widths)))
    for side in sides:
        print(f"{side:{names}s} " + " ".join(fmt.format(median(side, name)) for name, (_, fmt) in columns.items()))
    print(f"ours (sync) = {best_sync}, the faster ours (sync); trl = {best_trl}, the faster trl")
    for name, side in compared.items():
        ratios = [median(side, column) / median(best_trl, column) for column in columns]
        print(f"{'ratio ' + name + '/trl':{names}s} " + " ".join(f"{r:{w}.2f}" for r, w in zip(ratios, widths)))

    print(
        f"\nseconds per generation batch by phase (medians){'':4s}" + " ".join(f"{p:>9s}" for p in (*PHASES, "total"))
    )
    for side in sides:
        row = " ".join(f"{statistics.median(run.phases[p] for run in results[side]):9.4f}" for p in (*PHASES, "total"))
        print(f"{side:51s}{row}")
    print("  (async: generate and reward run in the collector process while the learner updates; the learner's step")
    print("   is reference + advantage + update + other, where other is mostly its wait for the next batch)")

    if args.sampler_dtype:

        def phase(side: str, name: str) -> float:
            return statistics.median(run.phases[name] for run in results[side])

        print(
            f"the {args.sampler_dtype} sampler against the float32 one (ours (async), same rounds): generation "
            f"{phase(ASYNC, 'generate') / phase(ASYNC_BF16, 'generate'):.2f}x shorter, a step "
            f"{median(ASYNC, 's_per_step') / median(ASYNC_BF16, 's_per_step'):.2f}x shorter"
        )
    targets = {"ours (sync)": args.sync_target, "ours (async)": args.async_target}
    report = {
        "trl": best_trl,
        "ours (sync)": best_sync,
        "medians": {side: {name: median(side, name) for name in columns} for side in sides},
        "phases": {
            side: {p: statistics.median(run.phases[p] for run in results[side]) for p in (*PHASES, "total")}
            for side in sides
        },
        "ratios": {},
    }
    for name, side in compared.items():
        ratio = median(side, "tokens_per_s") / median(best_trl, "tokens_per_s")
        # The sides of a round run minutes apart at most: their ratio cancels slow drifts in the machine's load.
        paired = statistics.median(
            o.tokens_per_s / t.tokens_per_s for o, t in zip(results[side], results[best_trl], strict=True)
        )
        report["ratios"][name] = {"tokens_per_s": ratio, "paired": paired, "target": targets[name]}
        verdict = "meets" if ratio >= targets[name] else "misses"
        print(
            f"{name} runs at {ratio:.2f}x trl's generated tokens per second of training (median of per-round ratios "
            f"{paired:.2f}x; {side} against {best_trl}): {verdict} the target >= {targets[name]:.2f}x."
        )
    if args.memory:
        report["memory_mb"] = _memory_report(args, [best_sync, ASYNC, best_trl])
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return results


if __name__ == "__main__":
    main()
