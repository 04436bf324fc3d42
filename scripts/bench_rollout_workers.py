"""Sampling workers apart from the learner (``interop.sampling.workers.RolloutWorkers``): a Ray worker against a local
worker process, side by side in one run, and the figures a scale-out estimate needs.

    python scripts/bench_rollout_workers.py                       # tiny policy, 64 completions x 32 tokens, 5 rounds
    python scripts/bench_rollout_workers.py --quick               # smoke (well under a minute)
    python scripts/bench_rollout_workers.py --model /tmp/real_vocab/policy --rows 16   # a real vocabulary (V=151,936)

One worker of each backend (``processes``: a child process on shared memory; ``ray``: an actor on a local Ray cluster
of 2 CPUs this script starts), the same policy, prompts (``--rows`` completions, groups of 8, of the synthetic review
task), exactly ``--tokens`` tokens per completion (``min_new_tokens`` = ``max_new_tokens``) and torch threads (1).
Each round publishes new weights (what a learner does after every update: the time is ``publish_s``, plus the
worker's load of them inside its batch) and samples one batch with each backend, the order rotating; round 0 warms up
and is not counted. Medians: completion tokens per second of a batch (from submit to result, weights' load included)
and the Ray / processes ratio (the issue's target: at least 0.9x).

The estimate (``--estimate``): the batch split over W = 1, 2, 4, 8 workers on separate machines takes, per
batch, the slowest shard's sampling (measured: one Ray worker sampling rows / W completions) plus the weight
publication (measured); it ignores the network (weights cross it once per update: their size is printed) and
assumes machines like this one. It is an estimate, not a measurement of several machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
PRODUCTS = ("mug", "lamp", "bike", "desk", "chair", "phone", "bag", "watch", "kettle", "sofa", "pen", "clock")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO_ROOT / "tiny" / "policy"), help="policy folder (tiny/policy)")
    parser.add_argument("--rows", type=int, default=64, help="completions per batch, in groups of 8 (default 64)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per completion (default 32)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up (default 5)")
    parser.add_argument("--estimate", action="store_true", help="also measure the figures of the W-worker estimate")
    parser.add_argument("--quick", action="store_true", help="smoke: 16 rows of 8 tokens, 1 round")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.tokens, args.rounds = 16, 8, 1
    return args


def _prompts(tokenizer, rows: int) -> list[list[int]]:
    groups = rows // 8
    ids = []
    for index in range(groups):
        message = [{"role": "user", "content": f"Review the {PRODUCTS[index % len(PRODUCTS)]}."}]
        row = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids += [list(row["input_ids"])] * 8
    return ids


def _batch(workers, model, prompts, version: int) -> tuple[float, float, int, float]:
    """publish_s, batch_s (submit to result), completion tokens, sample_s (the workers' own sampling time, slowest;
    batch_s - sample_s is what reaching them costs: the weights' load, the prompts and rows in transit)."""
    started = time.perf_counter()
    workers.publish(model, version=version)
    published = time.perf_counter()
    workers.submit(prompts, group_size=8)
    rollout, _ = workers.result()
    done = time.perf_counter()
    tokens = int(rollout.get("completion_length").sum())
    rates = [value for name, value in workers.last_stats.items() if name.endswith("/tokens_per_s")]
    return published - started, done - published, tokens, tokens / len(rates) / min(rates)


def main(argv=None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interop.sampling import SamplingSettings
    from interop.sampling.workers import RolloutWorkers, connect_ray, disconnect_ray

    args = parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    prompts = _prompts(tokenizer, args.rows)
    settings = SamplingSettings(max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    connect_ray(num_cpus=2)
    backends = {}
    try:
        for backend in ("processes", "ray"):
            backends[backend] = RolloutWorkers(
                model, tokenizer, settings=settings, eos_token_ids=[tokenizer.eos_token_id], backend=backend, seed=0
            )
            backends[backend].wait_until_ready()
        figures = {name: {"publish_s": [], "batch_s": [], "sample_s": [], "tokens_per_s": []} for name in backends}
        order = list(backends)
        for round_index in range(args.rounds + 1):
            for name in order if round_index % 2 == 0 else order[::-1]:
                with torch.no_grad():  # new weights each round, as after an update
                    for parameter in model.parameters():
                        parameter.mul_(1.0 + 1e-4)
                publish_s, batch_s, tokens, sample_s = _batch(backends[name], model, prompts, version=round_index)
                if round_index == 0:
                    continue  # warm-up
                figures[name]["publish_s"].append(publish_s)
                figures[name]["batch_s"].append(batch_s)
                figures[name]["sample_s"].append(sample_s)
                figures[name]["tokens_per_s"].append(tokens / batch_s)
        medians = {
            name: {key: statistics.median(values) for key, values in table.items()} for name, table in figures.items()
        }
        ratio = medians["ray"]["tokens_per_s"] / medians["processes"]["tokens_per_s"]
        result = {"medians": medians, "ray_over_processes": ratio, "rows": args.rows, "tokens": args.tokens}
        print(f"{args.rows} completions x {args.tokens} tokens, {args.rounds} rounds, model {args.model}")
        for name, values in medians.items():
            print(
                f"  {name:9s} {values['tokens_per_s']:9.0f} tokens/s  batch {values['batch_s']:.3f} s (of which "
                f"sampling in the worker {values['sample_s']:.3f} s)  publish {values['publish_s'] * 1000:.1f} ms"
            )
        print(f"  ray / processes: {ratio:.2f}x (target >= 0.9x: {'met' if ratio >= 0.9 else 'NOT met'})")
        if args.estimate:
            result["estimate"] = _estimate(backends["ray"], model, prompts, medians["ray"]["publish_s"], args)
    finally:
        for workers in backends.values():
            workers.close()
        disconnect_ray()
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return result


def _estimate(workers, model, prompts, publish_s: float, args) -> dict:
    """tokens/s of a batch split over W workers on separate machines, from one worker's time on rows / W rows."""
    from interop.sampling.workers import published_state

    size_mb = published_state(model).nbytes / 2**20
    print(f"  estimate (not measured on several machines): weights {size_mb:.1f} MiB cross the network per update")
    estimate = {"weights_mib": size_mb, "publish_s": publish_s, "workers": {}}
    for count in (1, 2, 4, 8):
        rows = len(prompts) // count // 8 * 8
        if rows == 0:  # fewer groups than workers: the extra workers would idle
            break
        shard = prompts[:rows]
        times = []
        for round_index in range(max(2, args.rounds)):
            _, batch_s, _, _ = _batch(workers, model, shard, version=10_000 + count * 100 + round_index)
            times.append(batch_s)
        shard_s = statistics.median(times)
        tokens_per_s = len(prompts) * args.tokens / (shard_s + publish_s)
        estimate["workers"][count] = {"shard_rows": rows, "shard_s": shard_s, "tokens_per_s": tokens_per_s}
        print(
            f"  W={count}: shard of {rows} rows {shard_s:.3f} s + publish {publish_s:.3f} s "
            f"-> ~{tokens_per_s:.0f} tokens/s"
        )
    return estimate


if __name__ == "__main__":
    main()
