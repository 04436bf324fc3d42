"""How long a sampling child takes to start, spawned or forked from the fork server, side by side.

Starts ``--children`` :class:`interop.BackgroundSampler` processes one after another (as the async jobs of a Hydra
sweep do in one process) on the tiny policy, each start method in a new Python of its own (so that each begins without
a fork server), and prints per child: how long its constructor blocked the caller, when it was ready to sample, and
its CPU seconds until then (with the fork server, the server's own CPU, its imports, on the first line). Load on the
machine changes the seconds, much less the CPU seconds: compare the two methods from one run.

    python scripts/bench_child_start.py --children 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _measure(start_method: str, children: int, policy: str) -> list[dict]:
    """Runs in the new Python: the figures of ``children`` samplers started one after another."""
    from multiprocessing import forkserver

    import psutil
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interop.sampling import SamplingSettings
    from interop.sampling.background import BackgroundSampler

    tokenizer = AutoTokenizer.from_pretrained(policy, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(policy)
    rows = []
    for index in range(children):
        started = time.perf_counter()
        sampler = BackgroundSampler(
            model,
            tokenizer,
            settings=SamplingSettings(max_new_tokens=4),
            eos_token_ids=[tokenizer.eos_token_id],
            start_method=start_method,
        )
        blocked = time.perf_counter() - started
        sampler.wait_until_ready()
        ready = time.perf_counter() - started
        cpu = sum(psutil.Process(sampler.pid).cpu_times()[:2])
        server = forkserver._forkserver._forkserver_pid if start_method == "forkserver" and index == 0 else None
        server_cpu = sum(psutil.Process(server).cpu_times()[:2]) if server else 0.0
        rows.append({"blocked_s": blocked, "ready_s": ready, "child_cpu_s": cpu, "server_cpu_s": server_cpu})
        sampler.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--children", type=int, default=3, help="samplers started one after another per method")
    parser.add_argument("--policy", default=str(REPO_ROOT / "tiny" / "policy"), help="the model folder")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the start method, in the new Python
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(_measure(args.measure, args.children, args.policy)))
        return
    figures = {}
    for method in ("spawn", "forkserver"):
        command = [sys.executable, __file__, "--measure", method, "--children", str(args.children)]
        result = subprocess.run(
            [*command, "--policy", args.policy], capture_output=True, text=True, check=True, cwd=REPO_ROOT
        )
        figures[method] = json.loads(result.stdout.strip().splitlines()[-1])
    print("child  | spawn: blocked  ready  CPU s | forkserver: blocked  ready  CPU s (+ server's)")
    for index, (spawn, fork) in enumerate(zip(figures["spawn"], figures["forkserver"], strict=True)):
        server = f" (+ {fork['server_cpu_s']:.2f})" if fork["server_cpu_s"] else ""
        print(
            f"{index:>5}  | {spawn['blocked_s']:13.2f} {spawn['ready_s']:6.2f} {spawn['child_cpu_s']:6.2f} "
            f"| {fork['blocked_s']:19.2f} {fork['ready_s']:6.2f} {fork['child_cpu_s']:6.2f}{server}"
        )
    total = {method: sum(row["child_cpu_s"] + row["server_cpu_s"] for row in rows) for method, rows in figures.items()}
    print(
        f"CPU s of {args.children} starts: spawn {total['spawn']:.2f}, forkserver {total['forkserver']:.2f} "
        f"({total['spawn'] / max(total['forkserver'], 1e-9):.1f}x less)"
    )


if __name__ == "__main__":
    main()
