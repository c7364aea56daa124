"""Per-call CPU time of the grouped-tensor support predicates, uncached (``__wrapped__``) vs cached.

    python benchmarks/support_overhead.py [--calls 200000] [--repeats 5]

Explicit device (as every internal call site passes it). A fake capability lookup stands in for
a Hopper GPU on CPU-only machines (it is only reached on misses and by the uncached path; with a
real GPU, pass --real-device). Reports the best of --repeats runs per case, and cached/uncached.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from te_dist import recipe as R  # noqa: E402
from te_dist import support as S  # noqa: E402


def per_call_us(fn, calls, repeats):
    return min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--real-device", action="store_true")
    args = ap.parse_args()
    if args.real_device:
        device = torch.device("cuda", torch.cuda.current_device())
        ctx = None
    else:
        device = torch.device("cuda", 0)
        ctx = S.set_capability_lookup(lambda d: (9, 0) if d.type == "cuda" else None)
        ctx.__enter__()
    # Python's own floor on this machine: a call of an empty function with the same signature.
    def empty(recipe, dtype, *, split_alignment=None, device=None):
        return True

    cases = [("None (bf16)", None, None), ("Float8Current", R.Float8CurrentScaling(), 16),
             ("MXFP8", R.MXFP8BlockScaling(), 32)]
    floor = per_call_us(lambda: empty(None, torch.bfloat16, split_alignment=16, device=device), args.calls, args.repeats)
    print(f"# device={device}  (empty-call floor {floor:.3f} us incl. the timing lambda)")
    print(f"{'predicate':<38}{'recipe':<16}{'uncached us':>12}{'cached us':>10}{'ratio':>8}")
    for pred in (S.is_module_grouped_tensor_supported, S.is_op_fuser_grouped_tensor_supported):
        for label, rec, al in cases:
            unc = per_call_us(lambda: pred.__wrapped__(rec, torch.bfloat16, split_alignment=al, device=device),
                              args.calls // 4, args.repeats)
            pred(rec, torch.bfloat16, split_alignment=al, device=device)
            cac = per_call_us(lambda: pred(rec, torch.bfloat16, split_alignment=al, device=device), args.calls,
                              args.repeats)
            print(f"{pred.__name__:<38}{label:<16}{unc:12.3f}{cac:10.3f}{cac / unc:8.3f}")
    if ctx is not None:
        ctx.__exit__(None, None, None)


if __name__ == "__main__":
    main()
