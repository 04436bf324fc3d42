"""The sampler's weight-first LM-head product at a real vocabulary, per row count, its candidate plans side by side.

Each decoding step of :func:`interop.sampling.sample_responses` feeds the head one row per response still decoding,
and CPU GEMM kernels run ``W @ x.T`` at speeds that jump about with the row count. In one process, alternating within
every round, this times for each row count: the product as one ``torch.mm`` into ``[V, rows]`` then copied into the
``[rows, V]`` logits (``mm``); the same after padding the rows with zero rows up to a larger count (``pad->P``: only
the real rows are copied out); the weight split into row blocks of B (``blocks B``, alone and after padding); oneDNN's
linear over the weight packed once for ``--pack-rows`` rows (``packed``, where this torch has oneDNN; the packing's own
time printed apart, as a sampling loop pays it once); and :func:`interop.sampling.sampler._head_for_few_rows` as it
stands in a loop that packed (``head``). Prints the median ms per product over the
rounds and each candidate's ratio to ``mm``, after checking that every candidate's logits are ``mm``'s up to float
rounding. Then the step after the head, ``--top-k`` of the logits (the recipe's default 50; 0: not timed): ``topk``
over the whole rows against :func:`interop.sampling.sampler._top_k`, the sampler's, checked to take the same values
first. Run alone (timings on 2 busy cores are noisy):

    flock /tmp/locks/bench.lock python scripts/bench_sampler_head.py --rounds 15 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _candidates(
    weight: torch.Tensor, hidden: torch.Tensor, pads: list[int], blocks: list[int], packed: torch.Tensor | None
) -> dict:
    """Name -> a function computing ``hidden``'s ``[rows, V]`` logits one way (buffers allocated once, as the
    sampler's are); ``packed``: the weight packed for oneDNN, or ``None`` where this torch cannot."""
    from interop.sampling.sampler import _FEW_ROWS_HEAD, _FewRowsHead, _head_for_few_rows, _into_rows

    rows, width = hidden.shape
    vocabulary = weight.shape[0]
    out = torch.empty(rows, vocabulary)

    def plain(padded: int, block: int | None):
        source = torch.cat([hidden, hidden.new_zeros(padded - rows, width)]) if padded > rows else hidden
        product = torch.empty(vocabulary, padded)
        step = block or vocabulary

        def run():
            for start in range(0, vocabulary, step):
                torch.mm(weight[start : start + step], source.t(), out=product[start : start + step])
            _into_rows(product, out)
            return out

        return run

    head = torch.nn.Linear(width, vocabulary, bias=False).requires_grad_(False)
    head.weight.data = weight
    state = _FewRowsHead()
    state._packed = packed  # as after the first call of a loop that packs
    setattr(head, _FEW_ROWS_HEAD, state)
    found = {"mm": plain(rows, None), "head": lambda: _head_for_few_rows(head, hidden)}
    if packed is not None:
        found["packed"] = lambda: torch.ops.mkldnn._linear_pointwise(hidden, packed, None, "none", [], "")
    for padded in pads:
        if padded > rows:
            found[f"pad->{padded}"] = plain(padded, None)
    for block in blocks:
        found[f"blocks {block}"] = plain(rows, block)
        above = [padded for padded in pads if padded > rows]
        if above:  # padded to the next count only
            found[f"pad->{above[0]} blocks {block}"] = plain(above[0], block)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabulary", type=int, default=151_936, help="the head's output size (Qwen2's)")
    parser.add_argument("--hidden", type=int, default=512, help="the head's input size (the speed policy's)")
    parser.add_argument("--rows", default="1-16,20,24,32,48,64", help="row counts: a comma list, ranges a-b")
    parser.add_argument("--pads", default="2,4,8,16", help="row counts the rows may be padded up to")
    parser.add_argument("--blocks", default="4096,16384", help="weight row-block sizes (empty: none)")
    parser.add_argument("--pack-rows", type=int, default=16, help="the row count the packed weight is packed for")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (each times every candidate once)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--top-k", type=int, default=50, help="the top-k of the logits timed after the head (0: none)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    counts = []
    for part in args.rows.split(","):
        low, _, high = part.partition("-")
        counts += list(range(int(low), int(high or low) + 1))
    pads = [int(p) for p in args.pads.split(",") if p]
    blocks = [int(b) for b in args.blocks.split(",") if b]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocabulary, args.hidden, generator=generator) * 0.02
    from interop.sampling.sampler import _packing_available

    packed, packing_ms = None, []
    for _ in range(3 if _packing_available() else 0):
        started = time.perf_counter()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, args.pack_rows)
        packing_ms.append((time.perf_counter() - started) * 1e3)
    plans = {}
    for rows in counts:
        plans[rows] = _candidates(weight, torch.randn(rows, args.hidden, generator=generator), pads, blocks, packed)
    for rows, found in plans.items():  # warm-up (first calls page in buffers), and no candidate timed if wrong
        expected = found["mm"]().clone()
        for name, run in found.items():
            logits = run().reshape(rows, -1)
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    times = _median_times(plans, args.rounds)

    print(f"V={args.vocabulary} H={args.hidden} threads={args.threads} rounds={args.rounds}: median ms (ratio to mm)")
    if packing_ms:
        print(f"packing the weight for {args.pack_rows} rows (once per sampling loop): {min(packing_ms):.1f} ms")
    else:
        print("packed: not timed, this torch has no oneDNN weight packing")
    for rows, medians in times.items():
        base = medians["mm"]
        cells = [f"{name} {median * 1e3:6.1f} ({median / base:4.2f})" for name, median in medians.items()]
        print(f"rows {rows:3d}: " + " | ".join(cells), flush=True)
    if args.top_k:
        _time_top_k(args, plans)


def _median_times(plans: dict, rounds: int) -> dict:
    """``{rows: {name: median seconds}}`` of ``plans``' ``{rows: {name: run}}``, every run timed once per round in
    turn (a slower spell of the machine falls on all of them alike)."""
    times: dict = {rows: {name: [] for name in runs} for rows, runs in plans.items()}
    for _ in range(rounds):
        for rows, runs in plans.items():
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[rows][name].append(time.perf_counter() - started)
    return {rows: {name: statistics.median(taken) for name, taken in runs.items()} for rows, runs in times.items()}


def _time_top_k(args, plans: dict) -> None:
    """Times ``topk`` over the whole rows of each row count's logits against the sampler's ``_top_k``."""
    from interop.sampling.sampler import SamplingSettings, _top_k

    settings = SamplingSettings(max_new_tokens=1, top_k=args.top_k)
    found = {}
    for rows, candidates in plans.items():
        logits = candidates["mm"]().clone()
        k = min(args.top_k, logits.shape[-1])
        values, _ = _top_k(logits, settings)
        whole = logits.topk(k, dim=-1).values
        assert torch.equal(values.sort(-1, descending=True).values, whole), f"_top_k at {rows} rows"
        found[rows] = {
            "topk": lambda logits=logits, k=k: logits.topk(k, dim=-1, sorted=False),
            "_top_k": lambda logits=logits: _top_k(logits, settings),
        }
    print(f"top-{args.top_k} of the logits, median ms (ratio to topk over the whole rows)")
    for rows, medians in _median_times(found, args.rounds).items():
        base, ours = medians["topk"], medians["_top_k"]
        print(
            f"top-k at {rows:3d} rows: topk {base * 1e3:6.2f} | _top_k {ours * 1e3:6.2f} ({ours / base:4.2f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
