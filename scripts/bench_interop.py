"""Throughput of ``interop.TorchRLBufferDataset`` against TorchRL's reference adapter, side by side in one run.

What it measures (samples per second, medians over interleaved repetitions, so that machine noise hits every
contender alike):

- ``sample()``: the replay buffer's own ``rb.sample(batch)`` loop, the ceiling for any adapter;
- ``get+unbind``: ``sample()`` plus one read and one ``unbind`` per tensor key (no dicts), the floor of any adapter
  that yields per-sample tensors;
- ``reference``: ``torchrl.modules.llm.trl_interop.TorchRLBufferDataset`` (indexes the sampled batch per sample);
- ``ours``: ``interop.TorchRLBufferDataset`` (reads each key once per batch);

on a ``LazyTensorStorage``, a ``ListStorage`` and ragged rollouts in a ``LazyStackStorage`` (where the reference
crashes; ours is compared with itself on the same data padded to equal length). The data look like LLM rollouts:
``("tokens", "full")`` int64 tokens, ``("masks", "all_attention_mask")`` booleans, a float ``reward`` and, with
``--text``, the prompt text (strings make ``sample()`` itself several times slower). A last section times
``HFRewardModelWrapper`` against calling the model directly on the same padded batch, and TorchRL's reference
wrapper.

Targets (issue 3): ours >= 4x reference and >= 1/3 of ``sample()`` on LazyTensorStorage, >= 1.5x reference on
ListStorage, ragged >= 0.5x ours on the padded data; reward-wrapper overhead <= 5%. ``ours/get+unbind`` near 1
means nothing but torch's cost of one tensor view per key and sample is left. Torch runs single-threaded by default
(``--threads``): on a small shared machine OpenMP wake-ups dominate the 1 MB copies of ``sample()``.

Run it:

    python scripts/bench_interop.py            # 4096 x 512 tokens, batch 256 (about a minute on 2 cores)
    python scripts/bench_interop.py --text     # with prompt strings in every sample
    python scripts/bench_interop.py --quick    # small smoke run (a few seconds)
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack
from torchrl.data import LazyStackStorage, LazyTensorStorage, ListStorage, ReplayBuffer
from torchrl.modules.llm.trl_interop import TorchRLBufferDataset as ReferenceDataset

from interop import HFRewardModelWrapper, TorchRLBufferDataset

# Whether samples carry their prompt text (set by --text). Strings make the storage's own sample() several times
# slower (tensordict indexes non-tensor stacks item by item), so they are off by default, as in the figures.
TEXT = False


def make_rollouts(num: int, length: int, *, ragged: bool, seed: int = 0) -> list[TensorDict]:
    """One TensorDict per rollout, shaped like ``TransformersWrapper(pad_output=False)`` output."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (num,), generator=gen).tolist() if ragged else [length] * num
    return [
        TensorDict(
            {
                "tokens": {"full": torch.randint(0, 32000, (n,), generator=gen)},
                "masks": {"all_attention_mask": torch.ones(n, dtype=torch.bool)},
                "reward": torch.randn((), generator=gen),
                **({"text": {"prompt": f"prompt number {i}"}} if TEXT else {}),
            },
            batch_size=[],
        )
        for i, n in enumerate(lengths)
    ]


def padded(rollouts: list[TensorDict], length: int) -> TensorDict:
    """The same rollouts right-padded to ``length`` (mask False on the padding), as one dense batch."""
    tokens = torch.zeros(len(rollouts), length, dtype=torch.long)
    mask = torch.zeros(len(rollouts), length, dtype=torch.bool)
    for i, td in enumerate(rollouts):
        n = td["tokens", "full"].shape[0]
        tokens[i, :n] = td["tokens", "full"]
        mask[i, :n] = True
    return TensorDict(
        {
            "tokens": {"full": tokens},
            "masks": {"all_attention_mask": mask},
            "reward": torch.stack([td["reward"] for td in rollouts]),
            **({"text": {"prompt": [td["text", "prompt"] for td in rollouts]}} if TEXT else {}),
        },
        batch_size=[len(rollouts)],
    )


def make_buffers(num: int, length: int) -> dict[str, ReplayBuffer]:
    dense = make_rollouts(num, length, ragged=False)
    ragged = make_rollouts(num, length, ragged=True, seed=1)
    dense_batch = padded(dense, length)
    lazy_tensor = ReplayBuffer(storage=LazyTensorStorage(num))
    lazy_tensor.extend(dense_batch)
    list_storage = ReplayBuffer(storage=ListStorage(num))
    list_storage.extend(dense_batch)
    ragged_lazy = ReplayBuffer(storage=LazyStackStorage(num))
    ragged_lazy.extend(lazy_stack(ragged))
    ragged_padded = ReplayBuffer(storage=LazyTensorStorage(num))
    ragged_padded.extend(padded(ragged, length))
    return {
        "LazyTensorStorage": lazy_tensor,
        "ListStorage": list_storage,
        "LazyStackStorage (ragged)": ragged_lazy,
        "same data padded (LazyTensorStorage)": ragged_padded,
    }


def rate_of(run: Callable[[], int]) -> float:
    start = time.perf_counter()
    count = run()
    return count / (time.perf_counter() - start)


def sample_loop(rb: ReplayBuffer, batch: int, batches: int) -> Callable[[], int]:
    def run() -> int:
        for _ in range(batches):
            rb.sample(batch)
        return batch * batches

    return run


def unbind_loop(rb: ReplayBuffer, batch: int, batches: int) -> Callable[[], int]:
    """sample() plus one ``get`` and ``unbind`` per tensor key: what any per-sample tensor adapter has to pay."""

    def run() -> int:
        for _ in range(batches):
            data = rb.sample(batch)
            for key in data.keys(include_nested=True, leaves_only=True):
                data.get(key).unbind(0)
        return batch * batches

    return run


def dataset_loop(cls: type, rb: ReplayBuffer, batch: int, batches: int) -> Callable[[], int]:
    dataset = cls(rb, batch_size=batch, num_batches=batches)

    def run() -> int:
        count = 0
        for _ in dataset:
            count += 1
        return count

    return run


def crashes(cls: type, rb: ReplayBuffer, batch: int) -> str | None:
    """The error the adapter raises on this buffer, or None when it works."""
    try:
        for _ in cls(rb, batch_size=batch, num_batches=2):
            pass
    except Exception as err:  # noqa: BLE001 - the benchmark reports whatever the reference raises
        return f"{type(err).__name__}: {' '.join(str(err).split()[:4])}..."
    return None


def measure(contenders: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    """Median samples/s of each contender; repetitions interleave the contenders."""
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for run in contenders.values():  # warm-up
        run()
    for _ in range(repeats):
        for name, run in contenders.items():
            rates[name].append(rate_of(run))
    return {name: statistics.median(values) for name, values in rates.items()}


def bench_datasets(num: int, length: int, batch: int, batches: int, repeats: int) -> list[tuple[str, str]]:
    buffers = make_buffers(num, length)
    contenders: dict[str, Callable[[], int]] = {}
    reference_errors = {}
    for name, rb in buffers.items():
        contenders[f"{name} | sample()"] = sample_loop(rb, batch, batches)
        if "ragged" not in name:
            contenders[f"{name} | get+unbind"] = unbind_loop(rb, batch, batches)
        contenders[f"{name} | ours"] = dataset_loop(TorchRLBufferDataset, rb, batch, batches)
        reference_errors[name] = crashes(ReferenceDataset, rb, batch)
        if reference_errors[name] is None:
            contenders[f"{name} | reference"] = dataset_loop(ReferenceDataset, rb, batch, batches)
    med = measure(contenders, repeats)

    rows = []
    for name in buffers:
        ceiling, ours = med[f"{name} | sample()"], med[f"{name} | ours"]
        reference = med.get(f"{name} | reference")
        if reference is None:
            ref_txt, ratio = f"crash ({reference_errors[name]})", "-"
        else:
            ref_txt, ratio = f"{reference:>10,.0f}", f"{ours / reference:.2f}x"
        floor = med.get(f"{name} | get+unbind")
        floor_txt = "-" if floor is None else f"{floor:>10,.0f}"
        floor_ratio = "-" if floor is None else f"{ours / floor:.2f}"
        rows.append(
            (
                name,
                f"{ceiling:>10,.0f}",
                floor_txt,
                ref_txt,
                f"{ours:>10,.0f}",
                ratio,
                f"{ours / ceiling:.2f}",
                floor_ratio,
            )
        )
    ragged = med["LazyStackStorage (ragged) | ours"] / med["same data padded (LazyTensorStorage) | ours"]

    print(
        f"\nTorchRLBufferDataset: {num} x {length} tokens{' + prompt text' if TEXT else ''}, batch {batch}, "
        f"{batches} batches per run, median of {repeats} interleaved runs (samples/s)\n"
    )
    header = ("storage", "sample()", "get+unbind", "reference", "ours", "ours/ref", "ours/sample()", "ours/get+unbind")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)))
    print(f"\nragged LazyStackStorage / same data padded (ours): {ragged:.2f}x")
    lazy = rows[0]
    summary = [
        ("LazyTensorStorage ours/reference >= 4x", lazy[5]),
        ("LazyTensorStorage ours/sample() >= 0.33", lazy[6]),
        ("ListStorage ours/reference >= 1.5x", rows[1][5]),
        ("ragged / padded (ours) >= 0.5x", f"{ragged:.2f}x"),
    ]
    return summary


def bench_reward(batch: int, length: int, repeats: int) -> list[tuple[str, str]]:
    """HFRewardModelWrapper overhead over calling the model directly on the same padded batch."""
    from torchrl.modules.llm.trl_interop import HFRewardModelWrapper as ReferenceWrapper
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    model = Qwen2ForSequenceClassification(config).eval()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 1024, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    td = TensorDict({"tokens": {"full": tokens}, "masks": {"all_attention_mask": mask}}, batch_size=[batch])
    ours = HFRewardModelWrapper(model, inference_mode=True)
    reference = ReferenceWrapper(model, inference_mode=True)

    def direct() -> int:
        with torch.no_grad():
            model(input_ids=tokens, attention_mask=mask).logits.squeeze(-1).float()
        return batch

    contenders = {
        "model called directly": direct,
        "ours": lambda: ours(td.copy()).batch_size[0],
        "reference": lambda: reference(td.copy()).batch_size[0],
    }
    med = measure(contenders, repeats)
    base = med["model called directly"]
    print(
        f"\nHFRewardModelWrapper: {batch} x {length} tokens, tiny Qwen2 reward model on CPU, median of {repeats} "
        "interleaved runs\n"
    )
    for name, rate in med.items():
        print(f"  {name:<22} {rate:>9,.1f} samples/s   overhead {base / rate - 1:+.1%}")
    return [("reward wrapper overhead <= 5%", f"{base / med['ours'] - 1:+.1%}")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--num", type=int, default=4096, help="samples in each buffer")
    parser.add_argument("--length", type=int, default=512, help="tokens per sample (max for ragged)")
    parser.add_argument("--batch", type=int, default=256, help="batch size of each draw")
    parser.add_argument("--batches", type=int, default=8, help="draws per timed run")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repetitions")
    parser.add_argument("--text", action="store_true", help="add a prompt string to every sample")
    parser.add_argument("--skip-reward", action="store_true", help="skip the reward-wrapper section")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: on a small shared machine OpenMP wake-ups dominate 1 MB copies)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.num, args.length, args.batch, args.batches, args.repeats = 256, 64, 32, 2, 2
    global TEXT
    TEXT = args.text
    torch.set_num_threads(args.threads)
    set_list_to_stack(True).set()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    summary = bench_datasets(args.num, args.length, args.batch, args.batches, args.repeats)
    if not args.skip_reward:
        reward_batch, reward_length = (8, 32) if args.quick else (32, 256)
        summary += bench_reward(reward_batch, reward_length, args.repeats)
    print("\ntargets:")
    for name, value in summary:
        print(f"  {name:<45} {value}")


if __name__ == "__main__":
    main()
