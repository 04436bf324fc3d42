"""GRPO speed: ``recipes/grpo_torchrl_rm.py`` (TorchRL components) against ``trl.GRPOTrainer``, side by side.

    python scripts/bench_grpo.py                     # recipe defaults (G=8, 64 responses x 32 tokens), 5 rounds
    python scripts/bench_grpo.py --quick             # tiny smoke configuration (about half a minute on 2 cores)
    python scripts/bench_grpo.py --rounds 7 --steps 8 --updates-per-step 2 rollout.generation.max_new_tokens=48
    # bigger models, built offline (speed only: the reward head is untrained):
    python scripts/build_tiny_models.py --out /tmp/h512 --hidden-size 512 --num-layers 6 --pretrain-steps 20
    python scripts/bench_grpo.py model.name_or_path=/tmp/h512/policy reward_model.name_or_path=/tmp/h512/reward_base

Both sides run the same job, read from ONE composed recipe config (``conf/grpo_torchrl_rm.yaml`` plus the overrides
given on the command line): the same policy (``model.name_or_path``), reward model (``reward_model.name_or_path``,
an ``AutoModelForSequenceClassification``), prompts (``data=``; the synthetic task's by default, conversational
``[{"role": "user", ...}]`` prompts for trl), group size, responses per generation batch, maximum new tokens,
sampling (temperature, top-p, and top-k 50: the value ``generate`` uses when the recipe's YAML sets none), clip
epsilon, KL coefficient (``loss.kl_to_ref_coeff`` = trl's ``beta``, both with a frozen reference model), AdamW
settings, gradient clipping, a constant learning rate, float32 and the same torch thread count.

- ours: the recipe's own ``train(cfg)`` (composed with Hydra, ``logger=none``, no intermediate checkpoints), timed by
  the recipe itself: ``summary.json``'s ``wall_time_s`` (the training steps, setup apart) and ``generated_tokens``.
- trl: ``GRPOTrainer`` with ``per_device_train_batch_size`` = responses per optimizer step, ``num_generations`` = group
  size, ``steps_per_generation`` = optimizer steps per generation batch, ``num_iterations`` = the recipe's
  ``train.epochs_per_step``, ``gradient_accumulation_steps=1``, timed from ``on_train_begin`` to the last
  ``on_step_end``; its generated tokens are its completion masks summed (completion tokens up to and including EOS,
  as the recipe counts them).

Every response is ``max_new_tokens`` long on both sides by default (``min_new_tokens`` = ``max_new_tokens``): both
then do the same work, and the tokens per second compare speed rather than how long the responses of two differently
seeded runs happen to grow (``--natural-length`` lets them end at EOS). One optimizer step per generation batch by
default on both sides (``--updates-per-step 1`` sets the recipe's ``train.mini_batch_size`` to
``rollout.responses_per_step``; the recipe's own default, 2 updates of 32, is ``--updates-per-step 2``); both then
skip recomputing the old log-probs, which equal the current ones. Rounds alternate the sides (ours then trl, trl
then ours, ...) with fresh models every run, so machine load hits both alike; round 0 warms up imports and caches and
is not counted. Figures are medians over
rounds: generated tokens per second of training (generation, scoring and updates together), seconds per optimizer
step, and tokens per second of the rollout phase alone (ours: generation, reward, advantages, reference (and old)
log-probs; trl: ``_generate_and_score_completions``). Target: ours at least as fast as trl.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
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
# Same sampling on both sides: generate() applies top_k=50 when nothing sets it (the recipe's YAML does not, unless
# given +rollout.generation.top_k=...), while trl's GRPOConfig passes its own top_k (0 = off by default).
DEFAULT_TOP_K = 50


@dataclass
class Run:
    """One side's figures for one round."""

    tokens: int  # generated completion tokens, EOS included
    seconds: float  # the training steps' wall time, setup apart
    optimizer_steps: int
    rollout_seconds: float  # of which the rollout phase (generate, score, log-probs)
    responses: int

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
    return Run(
        tokens=int(summary["generated_tokens"]),
        seconds=summary["wall_time_s"],
        optimizer_steps=summary["steps"] * updates,
        # The recipe reports rollout throughput, tokens / rollout seconds: invert it for the rollout time.
        rollout_seconds=summary["generated_tokens"] / summary["tokens_per_s"],
        responses=summary["steps"] * cfg.rollout.responses_per_step,
    )


def extra_generation_kwargs(cfg) -> dict:
    """Generation settings of the recipe config that ``GRPOConfig`` has no field for (``min_new_tokens``...)."""
    known = {"max_new_tokens", "temperature", "top_p", "top_k", "do_sample", "return_log_probs"}
    return {str(k): v for k, v in cfg.rollout.generation.items() if k not in known}


def top_k(cfg) -> int:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, "rollout.generation.top_k", default=DEFAULT_TOP_K)


def make_trl_config(cfg, *, output_dir: str):
    """``GRPOConfig`` doing what the recipe config ``cfg`` does, step for step."""
    from trl import GRPOConfig

    per_step, mini = cfg.rollout.responses_per_step, cfg.train.mini_batch_size
    updates_per_generation = per_step // mini
    generation = cfg.rollout.generation
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
        gradient_accumulation_steps=1,
        steps_per_generation=updates_per_generation,
        num_iterations=cfg.train.epochs_per_step,
        num_generations=cfg.rollout.group_size,
        max_completion_length=generation.max_new_tokens,
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=top_k(cfg),
        generation_kwargs=extra_generation_kwargs(cfg) or None,
        max_steps=cfg.train.steps * updates_per_generation * cfg.train.epochs_per_step,
        learning_rate=cfg.optimizer.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        weight_decay=cfg.optimizer.weight_decay,
        max_grad_norm=cfg.train.max_grad_norm,
        beta=cfg.loss.kl_to_ref_coeff or 0.0,
        epsilon=cfg.loss.clip_epsilon,
        entropy_coef=cfg.loss.entropy_coeff,
        # GRPOLoss's token_mean averages over every token of the mini-batch: trl's "dapo"; prompt_mean is "grpo".
        loss_type="dapo" if cfg.loss.aggregation == "token_mean" else "grpo",
        scale_rewards="group",  # MCAdvantage divides by the group's standard deviation
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def run_trl(cfg, *, output_dir: str) -> Run:
    import datasets
    import torch
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from recipes.common.data import load_prompts
    from recipes.common.models import load_causal_lm, load_reward_model, load_tokenizer

    class TimedGRPOTrainer(GRPOTrainer):
        """Counts the generated tokens and times the rollout phase; trains exactly as ``GRPOTrainer``."""

        generated_tokens = 0
        generated_responses = 0
        rollout_seconds = 0.0

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            self.rollout_seconds += time.perf_counter() - start
            self.generated_tokens += int(output["completion_mask"].sum())
            self.generated_responses += output["completion_mask"].shape[0]
            return output

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = self.end = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.end = time.perf_counter()

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
    torch.manual_seed(cfg.seed)
    clock = StepClock()
    trainer = TimedGRPOTrainer(
        model=policy,
        reward_funcs=reward_model,
        args=make_trl_config(cfg, output_dir=output_dir),
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        reward_processing_classes=reward_tokenizer,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # keep the output to the measurements
    trainer.train()
    steps = trainer.state.global_step
    if steps != trainer.args.max_steps:
        raise RuntimeError(f"bench_grpo: trl ran {steps} optimizer steps, expected {trainer.args.max_steps}.")
    return Run(
        tokens=trainer.generated_tokens,
        seconds=clock.end - clock.begin,
        optimizer_steps=steps,
        rollout_seconds=trainer.rollout_seconds,
        responses=trainer.generated_responses,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration: " + " ".join(QUICK_OVERRIDES))
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds after the warm-up (default 5; quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="generation batches per run (default 5; quick 2)")
    parser.add_argument(
        "--updates-per-step",
        type=int,
        default=1,
        help="optimizer steps per generation batch, on both sides (the recipe's own default is 2)",
    )
    parser.add_argument(
        "--natural-length",
        action="store_true",
        help="let responses end at EOS (default: every response is max_new_tokens long on both sides, so that both "
        "do the same work whatever their runs learn)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="recipe config overrides for both sides, e.g. rollout.group_size=4"
    )
    args = parser.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    if args.rounds < 1 or args.steps < 1 or args.updates_per_step < 1:
        parser.error("--rounds, --steps and --updates-per-step must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, list[Run]]:
    args = parse_args(argv)

    import datasets
    import torch
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
    warnings.filterwarnings("ignore", message=".*is deprecated and will be removed in v6", category=FutureWarning)

    scratch = Path(tempfile.mkdtemp(prefix="bench_grpo."))

    def config_for(round_index: int, side: str):
        out = scratch / f"{round_index}-{side}"
        overrides = [*QUICK_OVERRIDES] if args.quick else []
        overrides += [
            f"output_dir={out}",
            f"hydra.run.dir={out}",
            "logger=none",
            "progress_bar=false",
            "checkpoint.every_n_steps=null",
            "checkpoint.keep_last=1",
            f"train.steps={args.steps}",
            f"seed={round_index}",
            *args.overrides,
        ]
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
            # Every response max_new_tokens long on both sides: the same work, whatever the two runs learn.
            overrides.append(f"+rollout.generation.min_new_tokens={cfg.rollout.generation.max_new_tokens}")
        return compose_config(overrides)

    cfg = config_for(0, "ours")
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    print(
        f"GRPO, ours (recipes/grpo_torchrl_rm.py) vs trl {__import__('trl').__version__} GRPOTrainer, "
        f"{'quick, ' if args.quick else ''}{args.rounds} rounds (+1 warm-up) of {args.steps} generation batches each\n"
        f"  policy {cfg.model.name_or_path}, reward model {cfg.reward_model.name_or_path}, data={cfg.data.source}\n"
        f"  group {cfg.rollout.group_size}, {cfg.rollout.responses_per_step} responses per generation batch, "
        f"{args.updates_per_step} optimizer step(s) of {cfg.train.mini_batch_size} per batch, max_new_tokens "
        f"{cfg.rollout.generation.max_new_tokens}, temperature {cfg.rollout.generation.temperature}, top_p "
        f"{cfg.rollout.generation.top_p}, top_k {top_k(cfg)}, "
        f"{'responses end at EOS' if args.natural_length else 'every response max_new_tokens long'}\n"
        f"  KL coefficient (trl beta) {cfg.loss.kl_to_ref_coeff}, clip {cfg.loss.clip_epsilon}, lr "
        f"{cfg.optimizer.lr}, {cfg.device} {cfg.dtype}, torch threads {torch.get_num_threads()}",
        flush=True,
    )

    sides = {"ours": lambda c, out: run_ours(c), "trl": lambda c, out: run_trl(c, output_dir=out)}
    results: dict[str, list[Run]] = {name: [] for name in sides}
    for round_index in range(args.rounds + 1):
        # Alternate who goes first, so that a drift in the machine's load does not favour one side.
        order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
        for name in order:
            cfg = config_for(round_index, name)
            gc.collect()
            run = sides[name](cfg, str(cfg.output_dir))
            label = "warm-up" if round_index == 0 else f"round {round_index}"
            print(
                f"  {label:8s} {name:4s} {run.tokens_per_s:9.1f} tokens/s {run.s_per_step:8.3f} s/step "
                f"{run.rollout_tokens_per_s:9.1f} rollout tokens/s ({run.tokens} tokens, {run.optimizer_steps} steps)",
                flush=True,
            )
            if round_index > 0:
                results[name].append(run)

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(run, field) for run in results[name])

    columns = {
        "tokens_per_s": ("tokens/s", "{:10.1f}"),
        "s_per_step": ("s/step", "{:10.3f}"),
        "rollout_tokens_per_s": ("rollout tokens/s", "{:17.1f}"),
        "tokens_per_response": ("tokens/response", "{:16.1f}"),
    }
    print(
        f"\n{'median over rounds':20s} "
        + " ".join(f"{title:>{len(fmt.format(0))}s}" for title, fmt in columns.values())
    )
    for name in sides:
        print(f"{name:20s} " + " ".join(fmt.format(median(name, field)) for field, (_, fmt) in columns.items()))
    ratios = {field: median("ours", field) / median("trl", field) for field in columns}
    widths = [len(fmt.format(0)) for _, fmt in columns.values()]
    print(f"{'ratio ours/trl':20s} " + " ".join(f"{ratios[f]:{w}.2f}" for f, w in zip(columns, widths)))
    # Both runs of a round are minutes apart at most: their ratio cancels slow drifts in the machine's load.
    paired = statistics.median(o.tokens_per_s / t.tokens_per_s for o, t in zip(results["ours"], results["trl"]))
    verdict = "meets" if ratios["tokens_per_s"] >= 1.0 else "misses"
    print(
        f"ours runs at {ratios['tokens_per_s']:.2f}x trl's generated tokens per second of training (median of "
        f"per-round ratios {paired:.2f}x): {verdict} the target >= 1.00x. An s/step ratio below 1 means ours is faster."
    )
    return results


if __name__ == "__main__":
    main()
