"""Host cost of the measured-choice lookup on the hot path, and of the file write after a miss
(runs on CPU: no GPU is touched).

    python benchmarks/autotune_overhead.py [--experts 8,64] [--calls 200000]

What a grouped-GEMM call adds once its bucket is in the table: the ``TE_DIST_TUNE`` read, the
bucket key (a tuple; with host group sizes, one pass to tell ragged from even) and a dict lookup,
plus the two closures te_dist.kernels builds for a possible miss. Printed per call in
microseconds, for tables of a few and of many buckets; the issue's bound is 1 us per call.

Second table: the wall time of ``Autotuner._save`` after one new bucket (what a miss pays after its
measurement, inside the bucket's 50 ms), against the same table encoded whole as indented JSON and
written the same way (the encoding before entries were encoded once), in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from te_dist.backends import autotune  # noqa: E402
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
    save_table()


def save_table(rounds: int = 15) -> None:
    from cutlass_kernels import cache

    timings = {("cutlass", 0): 1.2345678, ("torch", None): 1.3456789, ("cutlass", 2): 1.456789,
               ("cutlass", 3): 1.5678, ("cutlass", 10): 1.6789, ("loop", None): 2.0123}
    tuner = Autotuner(Settings(persist=False), identity=lambda i: ("cpu-bench", 1))
    directory = Path(tempfile.mkdtemp(prefix="te_dist_autotune_bench_"))
    print(f"\n{'buckets':>8}{'save ms':>10}{'indented ms':>13}{'ratio':>8}   (median of {rounds} misses)")
    for buckets in (32, 96, 288):
        table = autotune._Table(directory / f"t{buckets}.json")
        key = lambda i: ("fwd", torch.bfloat16, torch.bfloat16, 8, 1024 + 8 * i, 2048, 256, False, True)  # noqa: E731
        for i in range(buckets - rounds):
            table.put(key(i), timings)
        tuner._save(table, cache)  # every entry encoded once, as after a reload
        ours, indented = [], []
        for i in range(buckets - rounds, buckets):  # a miss adds one bucket, then writes the file
            table.put(key(i), timings)
            t0 = time.perf_counter()
            tuner._save(table, cache)
            t1 = time.perf_counter()
            data = {"version": autotune.FILE_VERSION, "torch": torch.__version__, "entries": table.to_entries()}
            cache.write_atomic(directory / "indented.json", json.dumps(data, indent=1, sort_keys=True).encode())
            t2 = time.perf_counter()
            ours.append((t1 - t0) * 1e3)
            indented.append((t2 - t1) * 1e3)
        a, b = statistics.median(ours), statistics.median(indented)
        print(f"{buckets:>8}{a:10.3f}{b:13.3f}{a / b:8.3f}")


if __name__ == "__main__":
    main()
