"""trl's ``GRPOTrainer`` with its own generation against the same trainer with TorchRL rollouts
(``interop.TorchRLRolloutFunc`` around the library's TorchRL sampler), synchronous and asynchronous, side by side in
one process.

    python scripts/bench_trl_rollouts.py                 # tiny models, 64 completions x 32 tokens, 5 rounds of 10 steps
    python scripts/bench_trl_rollouts.py --quick         # smoke configuration (well under a minute)
    # a real vocabulary (~97M parameters, V = 151,936), built offline in about a minute:
    python scripts/build_tiny_models.py --out /tmp/real_vocab --hidden-size 512 --num-layers 6 --pretrain-steps 20 \\
        --resize-vocab 151936
    python scripts/bench_trl_rollouts.py --rounds 2 --steps 3 --target 1.2 \\
        model.name_or_path=/tmp/real_vocab/policy reward_model.name_or_path=/tmp/real_vocab/reward_base \\
        rollout.responses_per_step=16

Equal work on both sides, read from one composed GRPO recipe config (``conf/grpo_torchrl_rm.yaml`` and the overrides
given): the same policy, reward model, prompts, group size, completions per step, ``max_new_tokens`` with every
completion that long (``min_new_tokens`` = ``max_new_tokens``: both sides generate exactly the same number of tokens),
sampling settings, one optimizer step per generation batch, the same ``loss_type`` and ``beta``, the same
``GRPOConfig`` (``scripts/bench_grpo.py``'s ``make_trl_config``), the same prompt stream (a TorchRL buffer trl reads
unshuffled, in one order for every side) and torch threads. The only difference is who generates, and when: trl
itself; TorchRL in trl's process, when trl asks (sync); TorchRL in a child process one generation batch ahead of
trl's update, on one more core (async: ``TorchRLRolloutFunc(mode="async")`` under ``interop.TorchRLGRPOTrainer``,
its process started before the first step). Rounds rotate the sides' order, with fresh models every run; round 0 warms
up and is not counted.
Figures are medians over rounds of generated tokens per second of training (from the first to the last optimizer
step), seconds per step and seconds per generation batch in each phase (generate: trl's ``_generate``, which with
TorchRL rollouts is the rollout function plus trl's decoding; reward; reference log-probs; the rest of scoring;
the update; other). The last lines give each mode's ratio and whether the faster meets ``--target``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_grpo  # noqa: E402  (this folder's sibling: the shared trl config, timing and phases)

TRL, SYNC, ASYNC = "trl", "trl + TorchRL (sync)", "trl + TorchRL (async)"
ASYNC_BF16 = "trl + TorchRL (async, bf16)"  # --sampler-dtype bfloat16: the child samples on a bf16 copy
SIDES = (TRL, SYNC, ASYNC)
MODES = {TRL: False, SYNC: "sync", ASYNC: "async", ASYNC_BF16: "async"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke: " + " ".join(bench_grpo.QUICK_OVERRIDES))
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds after the warm-up (default 5; quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 10; quick 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both sides (default 1)")
    parser.add_argument("--target", type=float, default=1.5, help="the ratio to reach (1.5 tiny, 1.2 real vocabulary)")
    parser.add_argument("--json", type=Path, default=None, help="also write the medians and the ratio to this file")
    parser.add_argument(
        "--sampler-dtype",
        choices=("bfloat16",),
        default=None,
        help="also run the async side with rollout.sampler_dtype=bfloat16 (a bf16 copy samples, cast at each push; "
        "the trainer stays in dtype), in the same rounds, its generation phase and step against the float32 one",
    )
    parser.add_argument("overrides", nargs="*", help="GRPO recipe config overrides for both sides")
    args = parser.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 10)
    if args.rounds < 1 or args.steps < 1 or args.threads < 1:
        parser.error("--rounds, --steps and --threads must be >= 1")
    return args


def _config(args, run_index: int, scratch: Path, side: str):
    out = scratch / f"{run_index}-{list(MODES).index(side)}"
    overrides = [*(bench_grpo.QUICK_OVERRIDES if args.quick else []), f"output_dir={out}", f"hydra.run.dir={out}"]
    overrides += [f"train.steps={args.steps}", f"seed={run_index}", *args.overrides]
    if side == ASYNC_BF16:
        overrides.append(f"rollout.sampler_dtype={args.sampler_dtype}")
    cfg = bench_grpo.compose_config(overrides)
    # One optimizer step per generation batch; every completion max_new_tokens long.
    overrides += [
        f"train.mini_batch_size={cfg.rollout.responses_per_step}",
        f"rollout.generation.min_new_tokens={cfg.rollout.generation.max_new_tokens}",
    ]
    return bench_grpo.compose_config(overrides)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bench_grpo._setup_process()
    scratch = Path(tempfile.mkdtemp(prefix="bench_trl_rollouts."))
    cfg = _config(args, 0, scratch, TRL)
    if cfg.reward_model is None:
        raise SystemExit("bench_trl_rollouts.py scores with the reward model on both sides; keep a reward_model.")
    print(
        f"trl {__import__('trl').__version__} GRPOTrainer: its own generation vs TorchRL rollouts "
        f"(interop.TorchRLRolloutFunc, sync and async), {args.rounds} rounds (+1 warm-up) of {args.steps} steps\n"
        f"  policy {cfg.model.name_or_path}, reward model {cfg.reward_model.name_or_path}, group "
        f"{cfg.rollout.group_size}, {cfg.rollout.responses_per_step} completions x "
        f"{cfg.rollout.generation.max_new_tokens} tokens per step (every completion that long),\n"
        f"  one optimizer step per batch, loss_type {cfg.loss.type}, beta "
        f"{cfg.loss.kl_to_ref_coeff or 0.0}, {args.threads} torch thread(s)",
        flush=True,
    )
    sides = SIDES + ((ASYNC_BF16,) if args.sampler_dtype else ())
    results: dict[str, list[bench_grpo.Run]] = {side: [] for side in sides}
    for round_index in range(args.rounds + 1):
        shift = round_index % len(sides)
        order = sides[shift:] + sides[:shift]  # each side first in turn
        for side in order:
            run_cfg = _config(args, round_index, scratch, side)
            run = bench_grpo.run_trl(
                run_cfg,
                output_dir=str(run_cfg.output_dir),
                threads=args.threads,
                torchrl_rollouts=MODES[side],
                stream=True,
            )
            label = "warm-up" if round_index == 0 else f"round {round_index}"
            print(
                f"  {label:8s} {side:24s} {run.tokens_per_s:9.1f} tokens/s {run.s_per_step:8.3f} s/step "
                f"({run.tokens} tokens, {run.optimizer_steps} steps)",
                flush=True,
            )
            if round_index > 0:
                results[side].append(run)

    def median(side: str, name: str) -> float:
        return statistics.median(getattr(run, name) for run in results[side])

    def phase(side: str, name: str) -> float:
        return statistics.median(run.phases[name] for run in results[side])

    phases = (*bench_grpo.PHASES, "total")
    print(f"\n{'median over rounds':26s} {'tokens/s':>10s} {'s/step':>9s}   " + " ".join(f"{p:>9s}" for p in phases))
    for side in sides:
        row = " ".join(f"{phase(side, p):9.4f}" for p in phases)
        print(f"{side:26s} {median(side, 'tokens_per_s'):10.1f} {median(side, 's_per_step'):9.4f}   {row}")
    print("  (phases: seconds per generation batch; generate is trl's _generate, the rollout function included)")
    ratios, paired, generate_ratios = {}, {}, {}
    for side, mode in ((SYNC, "sync"), (ASYNC, "async")):
        ratios[mode] = median(side, "tokens_per_s") / median(TRL, "tokens_per_s")
        paired[mode] = statistics.median(
            ours.tokens_per_s / theirs.tokens_per_s for ours, theirs in zip(results[side], results[TRL], strict=True)
        )
        generate_ratios[mode] = phase(TRL, "generate") / phase(side, "generate")
        print(
            f"trl with TorchRL rollouts ({mode}) runs at {ratios[mode]:.2f}x trl's generated tokens per second "
            f"(median of per-round ratios {paired[mode]:.2f}x; generation's wait {generate_ratios[mode]:.2f}x "
            "shorter)"
        )
    if args.sampler_dtype:
        ratios["async_bf16"] = median(ASYNC_BF16, "tokens_per_s") / median(TRL, "tokens_per_s")
        print(
            f"The {args.sampler_dtype} sampler against the float32 one (async, same rounds): generation's wait "
            f"{phase(ASYNC, 'generate') / phase(ASYNC_BF16, 'generate'):.2f}x shorter, a step "
            f"{median(ASYNC, 's_per_step') / median(ASYNC_BF16, 's_per_step'):.2f}x shorter"
        )
    best = max(ratios, key=ratios.get)
    verdict = "meets" if ratios[best] >= args.target else "misses"
    print(f"The faster mode, {best}, {verdict} the target >= {args.target:.2f}x.")
    report = {
        "medians": {
            side: {"tokens_per_s": median(side, "tokens_per_s"), "s_per_step": median(side, "s_per_step")}
            for side in sides
        },
        "phases": {side: {p: phase(side, p) for p in phases} for side in sides},
        "ratios": ratios,
        "paired_ratios": paired,
        "generate_ratios": generate_ratios,
        "target": args.target,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
