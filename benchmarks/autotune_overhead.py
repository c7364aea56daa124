"""Host cost of the measured-choice lookup on the hot path (runs on CPU: no GPU is touched).

    python benchmarks/autotune_overhead.py [--experts 8,64] [--calls 200000]

What a grouped-GEMM call adds once its bucket is in the table: the ``TE_DIST_TUNE`` read, the
bucket key (a tuple; with host group sizes, one pass to tell ragged from even) and a dict lookup,
plus the two closures te_dist.kernels builds for a possible miss. Printed per call in
microseconds, for tables of a few and of many buckets; the issue's bound is 1 us per call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from te_dist.backends.autotune import Autotuner, MissContext, Settings  # noqa: E402
from te_dist.backends.selection import Problem  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", default="8,64")
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()
    timer = lambda fn, calls: 1.0  # noqa: E731
    print(f"{'experts':>8}{'sizes':>8}{'buckets':>9}{'lookup us':>11}{'+closures us':>14}")
    for E in map(int, args.experts.split(",")):
        for sizes in ((256,) * E, (512,) + (0,) + (256,) * (E - 2), None):
            for buckets in (1, 500):
                t = Autotuner(Settings(persist=False), timer=timer, identity=lambda i: ("cpu-bench", 1))
                ctx = lambda: MissContext(("torch", None), lambda c: (lambda: None), False, True)  # noqa: E731
                ctx2 = lambda: MissContext(("torch", None), lambda c: (lambda: None), True, True, (0, 2), lambda c: True)  # noqa: E731
                for b in range(buckets):  # fill the table
                    p = Problem("fwd", "cuda", (9, 0), torch.bfloat16, torch.bfloat16, E * 256, 4096 + 8 * b, 2048, E,
                                True, False, sizes is not None)
                    t.choose(p, 0, sizes, ctx2)
                p = Problem("fwd", "cuda", (9, 0), torch.bfloat16, torch.bfloat16, E * 256, 4096, 2048, E, True, False,
                            sizes is not None)
                assert t.choose(p, 0, sizes, ctx) is not None
                lookup = per_call_us(lambda: t.choose(p, 0, sizes, ctx), args.calls)
                args_ = (p, sizes)
                closures = per_call_us(lambda: t.choose(p, 0, sizes, lambda: (lambda c: lambda: args_, ctx)),
                                       args.calls)
                kind = "none" if sizes is None else "ragged" if len(set(sizes)) > 1 else "even"
                print(f"{E:>8}{kind:>8}{buckets:>9}{lookup:11.3f}{closures:14.3f}")


if __name__ == "__main__":
    main()
