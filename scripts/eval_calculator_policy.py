"""How often a policy calls the calculator task's tool, and how often it is right, on held-out prompts.

    python scripts/eval_calculator_policy.py                       # tiny/calculator_policy, 100 held-out prompts
    python scripts/eval_calculator_policy.py --model <folder> --prompts 200 --seeds 0 1 2

Each prompt is sampled as one dialog through ``interop.tools.dialogs.DialogSampler`` with the task's real ``multiply``
tool (``recipes/tasks/calculator.py``) run by ``interop.tools.ToolRunner``, at the sampling settings GRPO uses
(temperature 1, the whole vocabulary), and scored with the task's reward (``exact_answer_reward``). The prompts are
``data=calculator``'s eval prompts (``make_eval_task(n, seed=data.seed + 1)``, as ``recipes/common/data.py`` draws
them). Prints, per sampling seed: the share of dialogs that called the tool, the exact accuracy (overall, with and
without a call), the tool errors and how the dialogs ended.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interop.sampling import SamplingSettings
from interop.tools import ToolRunner, ToolStats
from interop.tools.dialogs import DialogSampler
from recipes.tasks import calculator

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_SEED = 1234  # conf/data/calculator.yaml's seed; the eval prompts are drawn with seed + 1


def evaluate(
    sampler: DialogSampler, prompts: list[str], solutions: list[str], *, seed: int, batch_size: int
) -> dict[str, float]:
    """One dialog per prompt, sampled in batches with ``seed``; the rates and counts the script prints."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    rewards, called, tools, endings = [], [], ToolStats(), Counter()
    for first in range(0, len(prompts), batch_size):
        dialogs = sampler.sample_prompts(prompts[first : first + batch_size])
        rewards += calculator.exact_answer_reward(dialogs.messages, solutions[first : first + batch_size])
        called += [stats.tools.calls > 0 for stats in dialogs.stats]
        tools += dialogs.tool_stats
        endings.update(stats.ended for stats in dialogs.stats)
    with_call = [reward for reward, call in zip(rewards, called) if call]
    without_call = [reward for reward, call in zip(rewards, called) if not call]
    return {
        "tool_call_rate": sum(called) / len(prompts),
        "accuracy": sum(rewards) / len(prompts),
        "accuracy_with_call": sum(with_call) / max(len(with_call), 1),
        "accuracy_without_call": sum(without_call) / max(len(without_call), 1),
        "calls": tools.calls,
        **{f"errors/{kind}": count for kind, count in sorted(tools.errors.items())},
        **{f"ended/{ending}": count / len(prompts) for ending, count in sorted(endings.items())},
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO_ROOT / "tiny" / "calculator_policy")
    parser.add_argument("--prompts", type=int, default=100, help="held-out prompts, one dialog each")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="sampling seeds")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48, help="per turn")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=50)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # tiny models on shared cores: more threads are slower (docs/benchmarks.md)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    prompts, columns = calculator.make_eval_task(args.prompts, seed=DATA_SEED + 1)
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    with ToolRunner(calculator.TOOLS, timeout_s=10.0, max_result_tokens=64, tokenizer=tokenizer) as runner:
        sampler = DialogSampler(model, tokenizer, runner, settings=settings, max_turns=args.max_turns)
        for seed in args.seeds:
            result = evaluate(sampler, prompts, columns["solution"], seed=seed, batch_size=args.batch_size)
            print(f"seed {seed}: " + ", ".join(f"{key} {value:.3g}" for key, value in result.items()), flush=True)


if __name__ == "__main__":
    main()
