"""Multi-turn tool dialogs with the KV cache kept across turns against a prefill of the whole dialog per turn.

    python scripts/bench_dialog_cache.py                 # tiny/calculator_policy, 64 dialogs a batch, 15 rounds
    python scripts/bench_dialog_cache.py --quick         # smoke: 3 rounds of 8 dialogs

Both ways sample the same batches with ``interop.tools.dialogs.DialogSampler`` and the calculator task's real tool: the
same policy (loaded once), prompts (``recipes.tasks.calculator.make_task``, each repeated ``--group`` times in a row
as GRPO samples them), settings and seed per round. The only difference is ``keep_cache_across_turns``. Rounds
alternate which way runs first, so neither always meets a warm or a cold machine first.

Each round reports generated tokens (the model's own, tool messages left out) per second of sampling (wall clock, and
this process's CPU time, the steadier of the two on shared cores), and whether
both ways sampled the same dialogs (they draw with the same random numbers; only float rounding of the logits
differs). The last lines give the medians over rounds and their ratio (kept / per-turn prefill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

KEPT, PREFILL = "cache kept across turns", "prefill per turn"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, default=REPO_ROOT / "tiny" / "calculator_policy")
    parser.add_argument("--quick", action="store_true", help="smoke: 3 rounds of 8 dialogs")
    parser.add_argument("--rounds", type=int, default=None, help="batches per way (default 15; quick 3)")
    parser.add_argument("--dialogs", type=int, default=None, help="dialogs per batch (default 64; quick 8)")
    parser.add_argument("--group", type=int, default=8, help="dialogs per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per turn")
    parser.add_argument("--max-turns", type=int, default=3, help="assistant turns per dialog")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path, default=None, help="also write every round and the medians to this file")
    args = parser.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (3 if args.quick else 15)
    args.dialogs = args.dialogs if args.dialogs is not None else (8 if args.quick else 64)
    args.group = min(args.group, args.dialogs)
    return args


def sample(sampler, prompts: list[str], *, keep: bool, seed: int) -> tuple[float, float, object]:
    """``(wall seconds, this process's CPU seconds, dialogs)``: on shared cores the CPU time is the steadier one."""
    import torch

    sampler.keep_cache_across_turns = keep
    torch.manual_seed(seed)
    start, start_cpu = time.perf_counter(), time.process_time()
    dialogs = sampler.sample_prompts(prompts)
    return time.perf_counter() - start, time.process_time() - start_cpu, dialogs


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interop.sampling import SamplingSettings
    from interop.tools import ToolRunner
    from interop.tools.dialogs import DialogSampler
    from recipes.tasks import calculator

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.policy, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.policy).eval()
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens)
    print(
        f"calculator task, {args.policy.name}: {args.rounds} rounds of {args.dialogs} dialogs (groups of "
        f"{args.group}), at most {args.max_turns} turns of {args.max_new_tokens} tokens, {args.threads} thread(s)",
        flush=True,
    )
    results = []
    with ToolRunner(calculator.TOOLS, timeout_s=10.0, max_result_tokens=32, tokenizer=tokenizer) as runner:
        sampler = DialogSampler(model, tokenizer, runner, settings=settings, max_turns=args.max_turns)
        # Starts the tool worker and runs a batch of each way once, unmeasured (the first batches allocate).
        warm_up, _ = calculator.make_task(args.dialogs // args.group, seed=10_000)
        for keep in (True, False):
            sample(sampler, [prompt for prompt in warm_up for _ in range(args.group)], keep=keep, seed=10_000)
        for round_index in range(args.rounds):
            distinct, _ = calculator.make_task(args.dialogs // args.group, seed=round_index)
            prompts = [prompt for prompt in distinct for _ in range(args.group)]
            order = (KEPT, PREFILL) if round_index % 2 == 0 else (PREFILL, KEPT)
            sampled = {}
            for way in order:
                seconds, cpu_seconds, dialogs = sample(sampler, prompts, keep=way == KEPT, seed=round_index)
                tokens = sum(sum(mask) for mask in dialogs.model_mask)
                turns = sum(stats.turns for stats in dialogs.stats) / len(dialogs)
                sampled[way] = dialogs
                results.append(
                    {
                        "way": way,
                        "round": round_index,
                        "seconds": seconds,
                        "cpu_seconds": cpu_seconds,
                        "tokens": tokens,
                        "turns_mean": turns,
                    }
                )
                print(
                    f"round {round_index}  {way:<24} {tokens / seconds:8.0f} tokens/s  {tokens / cpu_seconds:8.0f} "
                    f"tokens/CPU-s  {seconds:6.3f} s  ({tokens} tokens, {turns:.2f} turns/dialog)",
                    flush=True,
                )
            same = sum(a == b for a, b in zip(sampled[KEPT].completion_ids, sampled[PREFILL].completion_ids))
            results[-1]["same_dialogs"] = results[-2]["same_dialogs"] = same
            print(f"round {round_index}  the same dialogs both ways: {same}/{len(prompts)}", flush=True)
    medians = {}
    for way in (KEPT, PREFILL):
        mine = [r for r in results if r["way"] == way]
        medians[way] = {
            "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in mine),
            "tokens_per_cpu_s": statistics.median(r["tokens"] / r["cpu_seconds"] for r in mine),
            "seconds": statistics.median(r["seconds"] for r in mine),
        }
        print(
            f"median  {way:<24} {medians[way]['tokens_per_s']:8.0f} tokens/s  "
            f"{medians[way]['tokens_per_cpu_s']:8.0f} tokens/CPU-s  {medians[way]['seconds']:6.3f} s"
        )
    ratio = medians[KEPT]["tokens_per_s"] / medians[PREFILL]["tokens_per_s"]
    cpu_ratio = medians[KEPT]["tokens_per_cpu_s"] / medians[PREFILL]["tokens_per_cpu_s"]
    print(f"ratio   kept / prefill per turn: {ratio:.2f}x generated tokens/s, {cpu_ratio:.2f}x per CPU second")
    report = {"runs": results, "medians": medians, "ratio_tokens_per_s": ratio, "ratio_tokens_per_cpu_s": cpu_ratio}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
