"""Where a GRPO step of ``recipes/grpo_torchrl_rm.py`` (sync) spends its time, per phase and kind of work, against the
exact floor: the work any exact implementation of the same step does.

    python scripts/profile_grpo_step.py                       # the tiny models, 1 warm-up step + 3 profiled
    python scripts/profile_grpo_step.py --steps 2 --threads 2 --trl-step-s 9.76 rollout.responses_per_step=16 \\
        model.name_or_path=/tmp/real_vocab/policy reward_model.name_or_path=/tmp/real_vocab/reward_base
    python scripts/profile_grpo_step.py --measure-trl          # also time trl's step on the same job (bench_grpo's)

The job is ``scripts/bench_grpo.py``'s "ours (sync)" (its config: every response ``max_new_tokens`` long, one optimizer
step per generation batch, no checkpoints; the overrides given here on top), run by the recipe's own ``train(cfg)``
under ``torch.profiler`` after ``--warmup`` steps. Phases, marked without changing the recipe: generate (the sampling
policy's forward), reward (the rest of the collection: the env, the reward model), reference (the frozen reference's
log-probs), update (``optimize``: the loss, its backward, the optimizer), outside (the rest of the step: advantages,
metrics, batch handling). Each op's self CPU time goes to one category:

- LM-head products: a product (mm, addmm, bmm, ...) with the vocabulary V and the hidden size H among its shapes, or
  inside the recipe's chunked head (``_ChunkedHeadLogProbs``, whose ops see [rows, chunk] slices of [rows, V]);
- backbone products: the other products (the layers' projections and MLPs, the reward model's);
- attention: ``scaled_dot_product_attention`` and what it calls;
- exp / softmax passes over [*, V]: exp, softmax, log-softmax (and their backwards) with V in a shape;
- other passes over [*, V]: every other op with V in a shape (max, sums, gathers, in-place updates, the tied
  embedding's [V, H] gradient, copies, casts), or a shape that ends in V cut into blocks (the sampler's top-k reads
  each row's block maxima over [rows, V / 64, 64]);
- optimizer step: what ``Optimizer.step`` runs (AdamW);
- other ops: the remaining ops (norms, activations, rotary embeddings, the sampler's small ops...);
- not in an op: Python, dispatch and autograd's bookkeeping (the self time of the profiler's non-op ranges).

They add up to the step's wall time (the profiler's own overhead included: fractions are what compare). The exact
floor is the products, the attention and one exp per logits pass that needs one (each decoding step's, the
reference's, the update's forward and backward), the exps timed here on their own at the step's shapes; trl's step
over that floor is the best ratio against trl any exact implementation reaches on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
for _path in (REPO_ROOT, REPO_ROOT / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_grpo  # noqa: E402  (sets the offline environment; the job's config and trl's side)

PHASES = ("generate", "reward", "reference", "update", "outside")
CATEGORIES = (
    "LM-head products",
    "backbone products",
    "attention",
    "exp / softmax over [*, V]",
    "other passes over [*, V]",
    "optimizer step",
    "other ops",
    "not in an op",
)
FLOOR = ("LM-head products", "backbone products", "attention")
PRODUCTS = {
    "aten::mm",
    "aten::addmm",
    "aten::addmm_",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::mv",
    "aten::addmv",
    "aten::dot",
    "aten::_addmm_activation",
    "mkldnn::_linear_pointwise",  # the sampler's head over its oneDNN-packed weight
}
EXPS = {
    "aten::exp",
    "aten::exp_",
    "aten::softmax",
    "aten::_softmax",
    "aten::log_softmax",
    "aten::_log_softmax",
    "aten::_softmax_backward_data",
    "aten::_log_softmax_backward_data",
}
_MARK = "phase::"  # the record_function ranges this script opens
_CHUNKED_HEAD = "_ChunkedHeadLogProbs"  # recipes.grpo.log_probs' head over vocabulary chunks (and its backward)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before the profiler starts (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the recipe's num_threads; default 1)")
    parser.add_argument("--trl-step-s", type=float, default=None, help="trl's seconds per step (from bench_grpo)")
    parser.add_argument(
        "--measure-trl", action="store_true", help="time trl's step on the same job (bench_grpo's trl side), unprofiled"
    )
    parser.add_argument(
        "--top", type=int, default=0, help="also list each phase's N costliest ops outside the floor (name, shapes)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("overrides", nargs="*", help="recipe config overrides, e.g. rollout.responses_per_step=16")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--steps and --threads must be >= 1, --warmup >= 0")
    return args


def job_config(args: argparse.Namespace, scratch: Path):
    """bench_grpo's "ours (sync)" config at ``--threads``, for ``--warmup + --steps`` steps."""
    bench_args = bench_grpo.parse_args(
        ["--steps", str(args.warmup + args.steps), "--sync-threads", str(args.threads), *args.overrides]
    )
    side = f"ours (sync, {bench_grpo._threads(args.threads)})"
    return bench_args, bench_grpo._config_for(bench_args, side, 1, scratch)


class _Range:
    """A ``record_function`` range opened and closed by hand (from hooks and wrappers)."""

    def __init__(self, name: str) -> None:
        import torch

        self._range = torch.profiler.record_function(_MARK + name)

    def __enter__(self):
        self._range.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._range.__exit__(*exc)


class PhaseMarks:
    """Marks the recipe's phases with ``record_function`` ranges (by wrapping its functions, restored on exit), starts
    the profiler at the collection of step ``warmup + 1`` and stops it after step ``warmup + steps``' update; times
    each profiled step (collection start to the end of ``train_step``) with its own clock."""

    def __init__(self, warmup: int, steps: int) -> None:
        import torch

        self.warmup, self.steps = warmup, steps
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self.step_seconds: list[float] = []
        self._collected = 0
        self._trained = 0
        self._step = None
        self._step_start = 0.0
        self._restore: list = []

    def _profiling(self) -> bool:
        return self._step is not None

    def _patch(self, owner, name: str, replacement) -> None:
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def __enter__(self):
        import recipes.grpo.collector_modes as collector_modes
        import recipes.grpo.learner as learner_module
        import recipes.grpo_torchrl_rm as recipe

        timed_batches, train_step, optimize = collector_modes.timed_batches, recipe.train_step, recipe.optimize
        score = learner_module.ScoreLogProbs.__call__
        marks = self

        def marked_batches(collector, policy):
            policy.register_forward_pre_hook(lambda *_: marks._open("generate"))
            policy.register_forward_hook(lambda *_: marks._close())
            stream = timed_batches(collector, policy)
            while True:
                marks._collected += 1
                if marks._collected == marks.warmup + 1:
                    marks.profiler.start()
                if marks._collected > marks.warmup and marks._trained < marks.warmup + marks.steps:
                    marks._step_start = time.perf_counter()
                    marks._step = _Range("step").__enter__()
                marks._open("reward")  # the collection; the policy's forward inside it is "generate"
                try:
                    item = next(stream)
                finally:
                    marks._close()
                yield item

        def marked_train_step(*args, **kwargs):
            try:
                return train_step(*args, **kwargs)
            finally:
                marks._trained += 1
                if marks._profiling():
                    marks._step.__exit__(None, None, None)
                    marks._step = None
                    marks.step_seconds.append(time.perf_counter() - marks._step_start)
                    if marks._trained == marks.warmup + marks.steps:
                        marks.profiler.stop()

        def marked_optimize(*args, **kwargs):
            with marks._phase("update"):
                return optimize(*args, **kwargs)

        def marked_score(scorer, batch):
            with marks._phase("reference"):
                return score(scorer, batch)

        self._patch(collector_modes, "timed_batches", marked_batches)
        self._patch(recipe, "train_step", marked_train_step)
        self._patch(recipe, "optimize", marked_optimize)
        self._patch(learner_module.ScoreLogProbs, "__call__", marked_score)
        self._open_ranges: list[_Range] = []
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)

    def _open(self, name: str) -> None:
        self._open_ranges.append(_Range(name).__enter__() if self._profiling() else None)

    def _close(self) -> None:
        opened = self._open_ranges.pop()
        if opened is not None:
            opened.__exit__(None, None, None)

    @contextlib.contextmanager
    def _phase(self, name: str):
        self._open(name)
        try:
            yield
        finally:
            self._close()


def _has(shapes, size: int) -> bool:
    """Whether ``size`` is a dimension of any of an op's input shapes (nested for tensor lists)."""
    if isinstance(shapes, (list, tuple)):
        return any(_has(item, size) for item in shapes)
    return shapes == size


def _over(shapes, size: int) -> bool:
    """Whether an op's input shapes span ``size``: a dimension of ``size``, or last two dimensions whose product is
    ``size`` (a ``[*, size]`` tensor viewed as blocks)."""
    if not isinstance(shapes, (list, tuple)):
        return shapes == size
    blocked = len(shapes) >= 2 and all(isinstance(item, int) for item in shapes) and shapes[-2] * shapes[-1] == size
    return blocked or any(_over(item, size) for item in shapes)


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def categorize(event, *, vocab: int, hidden: int) -> tuple[str | None, str]:
    """``event``'s phase (its innermost phase range; ``None``: outside every profiled step) and category."""
    phase, in_step, attention, optimizer, head, einsum = None, False, False, False, False, False
    for ranged in (event, *_ancestors(event)):  # innermost first
        name = ranged.name
        if name.startswith(_MARK):
            mark = name[len(_MARK) :]
            in_step = in_step or mark == "step"
            phase = phase or (mark if mark != "step" else None)
        elif ranged is not event:
            attention = attention or "scaled_dot_product" in name
            optimizer = optimizer or name.startswith("Optimizer.step")
            # The chunked head's forward and backward: every op inside works on [rows, chunk] slices of [rows, V].
            head = head or name.startswith(_CHUNKED_HEAD)
            einsum = einsum or name == "aten::einsum"  # a row-wise dot product, not a product with the head
    name = event.name
    if not in_step:
        return None, ""
    phase = phase or "outside"
    if not name.startswith(("aten::", "mkldnn::")):  # mkldnn: the sampler's packed head and its packing
        return phase, "not in an op"
    if attention or "scaled_dot_product" in name:
        return phase, "attention"
    if optimizer:
        return phase, "optimizer step"
    shapes = event.input_shapes
    with_vocab = head or _over(shapes, vocab)
    if name in PRODUCTS and not einsum:
        is_head = head or (with_vocab and _has(shapes, hidden))
        return phase, "LM-head products" if is_head else "backbone products"
    if with_vocab:
        return phase, "exp / softmax over [*, V]" if name in EXPS else "other passes over [*, V]"
    return phase, "other ops"


def breakdown(events, *, vocab: int, hidden: int) -> dict[str, dict[str, float]]:
    """Seconds of self CPU time per phase and category, summed over ``events``."""
    table: dict[str, dict[str, float]] = {phase: defaultdict(float) for phase in PHASES}
    for event in events:
        phase, category = categorize(event, vocab=vocab, hidden=hidden)
        if phase is not None:
            table[phase][category] += event.self_cpu_time_total / 1e6
    return {phase: {category: table[phase][category] for category in CATEGORIES} for phase in PHASES}


def costliest(events, *, vocab: int, hidden: int, count: int) -> dict[str, list]:
    """Per phase, the ``count`` (op name, input shapes, category) outside the floor with the most self CPU time."""
    sums: dict[str, dict[tuple, float]] = {phase: defaultdict(float) for phase in PHASES}
    for event in events:
        phase, category = categorize(event, vocab=vocab, hidden=hidden)
        if phase is not None and category not in FLOOR:
            sums[phase][(event.name, str(event.input_shapes), category)] += event.self_cpu_time_total / 1e6
    return {
        phase: [[*key, seconds] for key, seconds in sorted(ops.items(), key=lambda item: -item[1])[:count]]
        for phase, ops in sums.items()
    }


def time_exp(rows: int, vocab: int, *, columns: int, repeats: int = 5) -> float:
    """Best-of seconds of one exp over ``[rows, vocab]`` float32 logits, ``columns`` at a time (as the head's chunks
    hold them)."""
    import torch

    logits = torch.randn(rows, min(columns, vocab))
    out = torch.empty_like(logits)
    chunks, rest = divmod(vocab, logits.shape[1])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(chunks):
            torch.exp(logits, out=out)
        if rest:
            torch.exp(logits[:, :rest], out=out[:, :rest])
        best = min(best, time.perf_counter() - start)
    return best


def exp_floor(cfg, *, vocab: int) -> dict[str, float]:
    """Per phase, the seconds of the exps an exact step cannot skip: one per decoding step over ``[responses, V]``
    (drawing needs the probabilities), one over the reference's ``[response tokens, V]`` logits, two over the
    update's (forward and backward)."""
    from recipes.grpo.log_probs import chunk_columns

    responses, new_tokens = cfg.rollout.responses_per_step, cfg.rollout.generation.max_new_tokens
    scored = responses * new_tokens
    one_pass = time_exp(scored, vocab, columns=chunk_columns(scored))
    return {
        "generate": new_tokens * time_exp(responses, vocab, columns=vocab),
        "reward": 0.0,
        "reference": one_pass,
        "update": 2 * one_pass * cfg.train.epochs_per_step,
        "outside": 0.0,
    }


def run(args: argparse.Namespace) -> dict:
    """Profiles the job; returns the per-step table, the step's wall time, the floor and the recipe's own phases."""
    import torch

    import recipes.grpo_torchrl_rm as recipe

    bench_grpo._setup_process()
    scratch = Path(tempfile.mkdtemp(prefix="profile_grpo."))
    bench_args, cfg = job_config(args, scratch)
    if cfg.train.epochs_per_step * (cfg.rollout.responses_per_step // cfg.train.mini_batch_size) != 1:
        raise SystemExit("profile_grpo_step: expects one optimizer step per generation batch (bench_grpo's default).")
    with PhaseMarks(args.warmup, args.steps) as marks:
        recipe.train(cfg)
    # The run's final checkpoint (1.1 GB at the real vocabulary) is never read here; metrics.csv is, below.
    shutil.rmtree(Path(cfg.output_dir) / "checkpoints", ignore_errors=True)
    events = marks.profiler.events()
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    vocab, hidden = model_config.vocab_size, model_config.hidden_size
    totals = breakdown(events, vocab=vocab, hidden=hidden)
    per_step = {p: {c: s / args.steps for c, s in row.items()} for p, row in totals.items()}
    with open(Path(cfg.output_dir) / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))[args.warmup :]
    recipe_phases = {
        phase: statistics.mean(float(row[f"perf/{key}_s"]) for row in rows)
        for phase, key in (("generate", "generate"), ("reward", "reward"), ("reference", "reference"))
    }
    recipe_phases["update"] = statistics.mean(float(row["perf/update_s"]) for row in rows)
    # A median: the first profiled step also holds the profiler's start, the last its stop (seconds at a time).
    recipe_phases["step"] = statistics.median(float(row["perf/step_time_s"]) for row in rows)
    torch.set_num_threads(args.threads)
    exps = exp_floor(cfg, vocab=vocab)
    floor = {p: sum(per_step[p][c] for c in FLOOR) + exps[p] for p in PHASES}
    result = {
        "config": {"vocab": vocab, "hidden": hidden, "threads": args.threads, "steps": args.steps},
        "per_step": per_step,
        "step_s": statistics.mean(marks.step_seconds),
        "recipe_phases": recipe_phases,
        "exp_floor": exps,
        "floor": floor,
        "trl_step_s": args.trl_step_s,
        "costliest": {
            p: [[*op[:3], op[3] / args.steps] for op in ops]
            for p, ops in costliest(events, vocab=vocab, hidden=hidden, count=args.top).items()
        },
    }
    if args.measure_trl:
        trl = bench_grpo.run_trl(cfg, output_dir=str(scratch / "trl"), threads=args.threads)
        result["trl_step_s"] = trl.s_per_step
    return result


def report(result: dict) -> None:
    per_step, step = result["per_step"], result["step_s"]
    config = result["config"]
    print(
        f"\nseconds per step by phase (self CPU time, {config['steps']} profiled steps, V = {config['vocab']}, "
        f"H = {config['hidden']}, {config['threads']} threads)"
    )
    print(f"{'':28s}" + "".join(f"{p:>10s}" for p in (*PHASES, "total")) + f"{'share':>8s}")
    for category in CATEGORIES:
        values = [per_step[p][category] for p in PHASES]
        print(
            f"{category:28s}" + "".join(f"{v:10.4f}" for v in values) + f"{sum(values):10.4f}{sum(values) / step:8.1%}"
        )
    phase_totals = [sum(per_step[p].values()) for p in PHASES]
    print(f"{'phase total':28s}" + "".join(f"{v:10.4f}" for v in phase_totals) + f"{sum(phase_totals):10.4f}")
    recipe_phases = result["recipe_phases"]
    print(
        f"{'the recipe`s own clocks':28s}"
        + "".join(f"{recipe_phases[p]:10.4f}" if p in recipe_phases else f"{'':10s}" for p in PHASES)
        + f"{recipe_phases['step']:10.4f}"
    )
    print(f"the step's wall time (this script's clock, profiled): {step:.4f} s")
    for phase, ops in result["costliest"].items():
        if ops:
            print(f"{phase}: the costliest ops outside the floor (s per step)")
        for name, shapes, category, seconds in ops:
            print(f"  {seconds:8.4f}  {name:36s} {category:26s} {shapes[:90]}")
    floor = result["floor"]
    exps = result["exp_floor"]
    print(
        "\nexact floor per step (products + attention + the needed exps, timed alone): "
        + ", ".join(f"{p} {floor[p]:.4f} (exps {exps[p]:.4f})" for p in PHASES if floor[p])
        + f"; total {sum(floor.values()):.4f} s = {sum(floor.values()) / step:.1%} of the profiled step"
    )
    outside_floor = step - sum(floor.values())
    print(f"the rest (what exact changes could still cut): {outside_floor:.4f} s")
    if result["trl_step_s"]:
        trl = result["trl_step_s"]
        print(
            f"trl's step {trl:.4f} s: trl / floor = {trl / sum(floor.values()):.2f}x (the best ratio an exact "
            f"implementation reaches), trl / this profiled step = {trl / step:.2f}x"
        )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
