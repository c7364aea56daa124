"""Two grouped-GEMM candidates of one sweep row, timed in three contexts: their ratio per context.

    python benchmarks/call_context.py [--rows NAME:DIR:ROUTING:A:B,...] [--rounds 6]

Why: the sweep's columns (benchmarks/grouped_gemm.py) time ten calls of one candidate in a row, while
live settling (te_dist/backends/live_settling.py) times one call at a time, alternating candidates.
Were a call's time to depend on what ran just before it (the H200's power state), two close tiles
could rank one way ten in a row and another call by call: this shows whether they do. Contexts, each
behind the sweep's preconditioning GEMMs: ``in_a_row`` ten calls of one between two events (the
sweep's columns); ``each_in_a_row`` ten calls of one, an event pair per call; ``alternating`` A, B,
A, B... an event pair per call. Each cell: the median ms over ``--rounds`` rounds (A and B swap
places every round), and B / A. Rows: the two near-ties the sweep of 2026-12-03 missed
(docs/benchmarks.md "Measured choices").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouped_gemm import _queued_start  # noqa: E402
from grouped_gemm_sweep import candidates, open_tiles, operands, sweep_gemms  # noqa: E402

from te_dist.backends import cutlass_backend  # noqa: E402

ROWS = "mixtral_8x22b_fc1_e8:dgrad:even:c0:c2,llama4_scout_fc1_e8:fwd:even:c2:c0"
CALLS = 10


def _event():
    return torch.cuda.Event(enable_timing=True)


def in_a_row(fn) -> float:
    """Ten calls of ``fn`` between two events: ms per call."""
    start, end = _queued_start(), _event()
    for _ in range(CALLS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS


def per_call(sequence) -> list:
    """``[(name, ms)]`` of the ``(name, fn)`` calls in order, an event pair around each."""
    _queued_start()
    marks = []
    for name, fn in sequence:
        start, end = _event(), _event()
        start.record()
        fn()
        end.record()
        marks.append((name, start, end))
    torch.cuda.synchronize()
    return [(name, start.elapsed_time(end)) for name, start, end in marks]


def contexts(a, b, fa, fb, rounds: int) -> dict:
    """{context: {a: ms, b: ms}}, the median over ``rounds`` rounds."""
    got = {c: {a: [], b: []} for c in ("in_a_row", "each_in_a_row", "alternating")}
    for r in range(rounds):
        pair = [(a, fa), (b, fb)] if r % 2 == 0 else [(b, fb), (a, fa)]
        for name, fn in pair:
            got["in_a_row"][name].append(in_a_row(fn))
            for _, ms in per_call([(name, fn)] * CALLS):
                got["each_in_a_row"][name].append(ms)
        for name, ms in per_call(pair * (CALLS // 2)):
            got["alternating"][name].append(ms)
    return {c: {n: statistics.median(v) for n, v in by.items()} for c, by in got.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=ROWS)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("call_context: needs a CUDA GPU", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    tiles = open_tiles(cutlass_backend.kernels_module())
    gemms = {g.name: g for g in sweep_gemms(4096)}
    print(f"# {torch.cuda.get_device_name()}; median of {args.rounds} rounds; ms per call, and B / A")
    print(f"{'row':40s} {'A':6s} {'B':6s} {'context':14s} {'A ms':>8s} {'B ms':>8s} {'B / A':>7s}")
    for row in args.rows.split(","):
        name, direction, routing, a, b = row.split(":")
        sizes, x, w, dy, off = operands(gemms[name], routing, dev)
        fns = candidates(direction, x, w, dy, off, sizes, tiles)
        for fn in (fns[a], fns[b]):
            for _ in range(3):  # warm-up: libraries loaded, plans made
                fn()
        for context, ms in contexts(a, b, fns[a], fns[b], args.rounds).items():
            print(f"{name + ' ' + direction + ' ' + routing:40s} {a:6s} {b:6s} {context:14s} "
                  f"{ms[a]:8.3f} {ms[b]:8.3f} {ms[b] / ms[a]:7.3f}", flush=True)
        del x, w, dy
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
