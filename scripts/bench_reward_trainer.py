"""RewardTrainer fed from the TorchRL preference buffer vs from an in-memory ``datasets.Dataset`` of the same pairs.

    python scripts/bench_reward_trainer.py                      # tiny reward model, 1024 pairs, 7 rounds
    python scripts/bench_reward_trainer.py --steps 200 --rounds 7 --batch-size 64

Both sides train the same model (fresh copy of ``tiny/reward_base`` each run, same seed) with the same
``RewardConfig`` from ``conf/reward_trainer_from_buffer.yaml`` for ``--steps`` optimizer steps:

- buffer: the recipe's path, ``make_training_stream`` (pairs tokenized once into a TorchRL ReplayBuffer, read by trl
  through ``interop.TorchRLBufferDataset(...).as_hf_dataset()``);
- in-memory: ``datasets.Dataset.from_list`` of the same conversational pairs, which trl tokenizes at init.

Runs alternate (buffer, in-memory, buffer, ...) after one warm-up run of each, so load on the machine hits both alike;
each side's optimizer steps per second is the median over rounds, timed around ``trainer.train()`` only (one-time
preparation is printed separately), and so is the cost of the data path alone (trl's dataloader iterated for as
many steps, no model). Target: buffer >= 0.95x in-memory.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def make_pairs(num_pairs: int, *, seed: int) -> list[dict]:
    """Conversational preference pairs of the synthetic task, labelled by its oracle (no policy needed)."""
    from recipes.tasks.synthetic import PRODUCTS, OracleLabeler, make_prompts, make_review

    rng = random.Random(seed)
    labeler = OracleLabeler(max_pairs_per_prompt=1)
    pairs = []
    for prompt in make_prompts(4 * num_pairs, seed=seed):
        product = next(p for p in PRODUCTS if p in prompt)
        for pair in labeler(prompt, [make_review(product, rng) for _ in range(4)]):
            pairs.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": pair["chosen"]}],
                    "rejected": [{"role": "assistant", "content": pair["rejected"]}],
                }
            )
        if len(pairs) == num_pairs:
            return pairs
    raise RuntimeError(f"could not label {num_pairs} pairs")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7, help="timed runs per side, after one warm-up each")
    parser.add_argument("overrides", nargs="*", help="extra recipe config overrides, e.g. num_threads=2")
    args = parser.parse_args(argv)

    import datasets
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from tensordict import set_list_to_stack
    from transformers import PrinterCallback
    from transformers.utils import logging as hf_logging
    from trl import RewardTrainer

    import recipes.reward_trainer_from_buffer as recipe
    from recipes.common.models import load_reward_model, load_tokenizer
    from recipes.common.schema import config_view
    from recipes.reward.buffer import make_training_stream
    from recipes.reward.pairs import LabelledPairs

    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    set_list_to_stack(True).set()
    out = Path(tempfile.mkdtemp(prefix="bench_reward_trainer."))
    overrides = [
        f"output_dir={out}",
        f"hydra.run.dir={out}",
        f"train.max_steps={args.steps}",
        f"train.per_device_train_batch_size={args.batch_size}",
        "train.logging_steps=1000000",  # logging is not what is measured
        "train.logging_first_step=false",
        *args.overrides,
    ]
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("reward_trainer_from_buffer", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    cfg = recipe.validate(cfg)  # the typed settings the recipe reads
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)

    tokenizer = load_tokenizer(cfg.reward_model, padding_side="right")
    pairs = make_pairs(args.pairs, seed=cfg.seed)
    labelled = LabelledPairs(train=pairs, eval=pairs[:1], conversational=True)

    def make_buffer_stream():
        return make_training_stream(cfg, labelled, tokenizer)[0]

    def make_in_memory():
        return datasets.Dataset.from_list(pairs)

    def run(make_dataset) -> dict[str, float]:
        prepare_start = time.perf_counter()
        dataset = make_dataset()
        torch.manual_seed(cfg.seed)
        model = load_reward_model(config_view(cfg.reward_model), device=cfg.device, dtype=cfg.dtype, trained=False)
        trainer = RewardTrainer(
            model, args=recipe.make_reward_config(cfg), train_dataset=dataset, processing_class=tokenizer
        )
        trainer.remove_callback(PrinterCallback)  # keep the output to the measurements
        prepare_s = time.perf_counter() - prepare_start
        # The data path alone: the batches trl's own dataloader yields for as many steps, collated, no model.
        start, batches = time.perf_counter(), 0
        while batches < args.steps:
            for _ in trainer.get_train_dataloader():
                batches += 1
                if batches == args.steps:
                    break
        data_ms = (time.perf_counter() - start) / args.steps * 1e3
        start = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - start
        if trainer.state.global_step != args.steps:
            raise RuntimeError(f"expected {args.steps} optimizer steps, got {trainer.state.global_step}")
        return {"steps_per_s": args.steps / train_s, "data_ms": data_ms, "prepare_s": prepare_s}

    sides = {"buffer (as_hf_dataset)": make_buffer_stream, "in-memory datasets.Dataset": make_in_memory}
    results = {name: [] for name in sides}
    print(
        f"{args.pairs} pairs, {args.steps} steps of {args.batch_size} pairs, {args.rounds} rounds, "
        f"torch threads {torch.get_num_threads()}"
    )
    for round_index in range(args.rounds + 1):
        for name, make_dataset in sides.items():
            result = run(make_dataset)
            if round_index > 0:  # round 0 warms up imports, allocator and caches
                results[name].append(result)
                print(
                    f"  round {round_index} {name:28s} {result['steps_per_s']:7.2f} steps/s, "
                    f"data path {result['data_ms']:.2f} ms/step"
                )

    def median(name: str, field: str) -> float:
        return statistics.median(r[field] for r in results[name])

    for name in sides:
        print(
            f"{name:28s} median {median(name, 'steps_per_s'):7.2f} optimizer steps/s, data path "
            f"{median(name, 'data_ms'):.2f} ms/step, one-time preparation {median(name, 'prepare_s'):.2f}s"
        )
    buffer_name, memory_name = list(sides)
    ratio = median(buffer_name, "steps_per_s") / median(memory_name, "steps_per_s")
    # Runs of one round are minutes apart at most: their ratio cancels slow drifts in the machine's load.
    paired = statistics.median(
        b["steps_per_s"] / m["steps_per_s"] for b, m in zip(results[buffer_name], results[memory_name], strict=True)
    )
    print(f"ratio buffer / in-memory: {ratio:.3f}x (median of per-round ratios {paired:.3f}x; target >= 0.95x)")


if __name__ == "__main__":
    main()
