"""trl's own tool loop (``GRPOTrainer(tools=[multiply])``) against trl with TorchRL sampling the dialogs
(``GRPOTrainer(rollout_func=interop.TorchRLRolloutFunc(tools=[multiply]))``) on the calculator task.

    python scripts/bench_trl_tools.py                    # tiny/calculator_policy, seeds 0 1 2, 30 steps each
    python scripts/bench_trl_tools.py --quick            # smoke: seed 0, 2 steps, 16 eval prompts

Both sides get the same policy (a fresh load per run), tools (``recipes.tasks.calculator.multiply``), training
prompts (``recipes.tasks.calculator.make_task``, one order for both: trl reads them unshuffled), reward
(``exact_answer_reward``), ``GRPOConfig`` (group size, completions per step, ``max_completion_length`` for the whole
dialog, temperature, learning rate, ``max_tool_calling_iterations`` = turns - 1), seed and torch threads. The only
difference is who samples the dialogs and runs the tools: trl (``model.generate`` per turn, the tools called in its
process) or TorchRL (``interop.tools.dialogs.DialogSampler``: the library's decoding loop, the tools in a worker
process). trl's tool loop parses the assistant turns with the tokenizer's ``response_template``; the calculator
policy's compact template is not one trl recognises, so the script sets trl's Qwen template object on it (the turns are
Qwen2.5's format).

Each run reports generated tokens (the model's own, tool messages left out, as trl's ``completions/mean_length``
counts them) per second of training, seconds per step, and the held-out accuracy before and after, measured the same
way for both sides (one sampled dialog per held-out prompt through TorchRL at the training's settings, a fixed seed).
The last lines give the medians over seeds and the speed ratio (TorchRL / trl).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

TRL, TORCHRL = "trl tools=", "trl + TorchRLRolloutFunc(tools=)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, default=REPO_ROOT / "tiny" / "calculator_policy")
    parser.add_argument("--quick", action="store_true", help="smoke: seed 0, 2 steps, 16 eval prompts")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (quick: 0)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 30; quick 2)")
    parser.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default 64; quick 16)")
    parser.add_argument("--completions", type=int, default=64, help="completions per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-completion-length", type=int, default=64, help="tokens per dialog, tools' included")
    parser.add_argument("--max-turns", type=int, default=2, help="assistant turns per dialog")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both sides")
    parser.add_argument("--json", type=Path, default=None, help="also write every run and the medians to this file")
    args = parser.parse_args(argv)
    args.seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 30)
    args.eval_prompts = args.eval_prompts if args.eval_prompts is not None else (16 if args.quick else 64)
    return args


def grpo_config(args, output_dir: str, seed: int):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        report_to="none",
        bf16=False,
        seed=seed,
        max_steps=args.steps,
        per_device_train_batch_size=args.completions,
        num_generations=args.group,
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_turns - 1,
        temperature=args.temperature,
        top_k=0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        shuffle_dataset=False,  # one prompt order for both sides
        disable_tqdm=True,
        activation_checkpointing=False,
        disable_dropout=True,
    )


def load_policy(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    return AutoModelForCausalLM.from_pretrained(path), tokenizer


def datasets_for(args, seed: int):
    import datasets

    from recipes.tasks import calculator

    prompts, columns = calculator.make_task(args.completions // args.group * args.steps, seed=1234 + seed)
    train = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts], **columns})
    held_out, solutions = calculator.make_eval_task(args.eval_prompts, seed=99)
    return train, ([[{"role": "user", "content": p}] for p in held_out], solutions["solution"])


def accuracy(trainer, args, held_out, seed: int) -> float:
    """One dialog per held-out prompt, sampled through TorchRL at the training's settings with a fixed seed, scored by
    the exact-answer reward: the same measure for both sides."""
    import torch

    from interop import TorchRLRolloutFunc
    from recipes.tasks import calculator

    prompts, solutions = held_out
    evaluator = TorchRLRolloutFunc(tools=list(calculator.TOOLS), max_turns=args.max_turns)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        evaluator.prepare(trainer)  # a dialog sampler around the trainer's model, at its GRPOConfig's settings
        rollout = evaluator.rollout(prompts, trainer=trainer)
    evaluator.close()
    lengths = rollout.get("completion_length").tolist()
    ids = [row[:n] for row, n in zip(rollout.get("completion_ids").tolist(), lengths, strict=True)]
    texts = evaluator.tokenizer.batch_decode(ids, skip_special_tokens=True)
    return sum(calculator.exact_answer_reward(texts, solution=solutions)) / len(texts)


def run(side: str, args, seed: int, scratch: Path) -> dict:
    import torch
    from trl import GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from interop import TorchRLRolloutFunc
    from recipes.tasks import calculator

    torch.manual_seed(seed)
    model, tokenizer = load_policy(args.policy)
    train, held_out = datasets_for(args, seed)
    config = grpo_config(args, str(scratch / f"{side[:3]}_{seed}"), seed)
    options = {}
    if side == TRL:
        tokenizer.response_template = qwen3_template  # the calculator template is Qwen2.5's format, unknown to trl
        options["tools"] = list(calculator.TOOLS)
    else:
        options["rollout_func"] = TorchRLRolloutFunc(tools=list(calculator.TOOLS))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=calculator.exact_answer_reward,
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        **options,
    )
    before = accuracy(trainer, args, held_out, seed)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = accuracy(trainer, args, held_out, seed)
    if side == TORCHRL:
        trainer.rollout_func.close()
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    tokens = sum(entry["completions/mean_length"] * args.completions for entry in logs)
    calls = [entry.get("tools/call_frequency", entry.get("rollout/tool_calls_per_dialog")) for entry in logs]
    result = {
        "side": side,
        "seed": seed,
        "steps": trainer.state.global_step,
        "train_s": seconds,
        "s_per_step": seconds / max(trainer.state.global_step, 1),
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "accuracy_before": before,
        "accuracy_after": after,
        "gain": after - before,
        "tool_calls_per_dialog_last": calls[-1] if calls else float("nan"),
    }
    print(
        f"seed {seed}  {side:<34} {result['tokens_per_s']:8.0f} tokens/s  {result['s_per_step']:6.2f} s/step  "
        f"accuracy {before:.2f} -> {after:.2f} (gain {after - before:+.2f})  tool calls/dialog "
        f"{result['tool_calls_per_dialog_last']:.2f}  ({int(tokens)} tokens, {result['steps']} steps)",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch
    from tensordict import set_list_to_stack

    set_list_to_stack(True).set()
    torch.set_num_threads(args.threads)
    print(
        f"calculator task, {args.policy.name}: {args.steps} steps of {args.completions} dialogs "
        f"(groups of {args.group}), "
        f"at most {args.max_turns} turns and {args.max_completion_length} tokens each, {args.eval_prompts} held-out "
        f"prompts, seeds {args.seeds}, {args.threads} thread(s)",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, seed in enumerate(args.seeds):
            order = (TRL, TORCHRL) if index % 2 == 0 else (TORCHRL, TRL)  # neither side always runs first
            for side in order:
                results.append(run(side, args, seed, Path(scratch)))
    medians = {}
    for side in (TRL, TORCHRL):
        mine = [r for r in results if r["side"] == side]
        medians[side] = {key: statistics.median(r[key] for r in mine) for key in ("tokens_per_s", "s_per_step", "gain")}
        gains = " / ".join(f"{r['gain']:+.2f}" for r in mine)
        print(
            f"median  {side:<34} {medians[side]['tokens_per_s']:8.0f} tokens/s  {medians[side]['s_per_step']:6.2f} "
            f"s/step  accuracy gain per seed {gains}"
        )
    ratio = medians[TORCHRL]["tokens_per_s"] / medians[TRL]["tokens_per_s"]
    step_ratio = medians[TRL]["s_per_step"] / medians[TORCHRL]["s_per_step"]
    print(f"ratio   TorchRL / trl: {ratio:.2f}x generated tokens/s, {step_ratio:.2f}x steps/s")
    report = {"runs": results, "medians": medians, "ratio_tokens_per_s": ratio, "ratio_steps_per_s": step_ratio}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
