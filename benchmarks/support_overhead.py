"""Per-call CPU time of the grouped-tensor support predicates, uncached (``__wrapped__``) vs cached.

    python benchmarks/support_overhead.py [--calls 200000] [--repeats 7] [--real-device]

Explicit device, as every internal call site passes it. A fake capability lookup stands in for a
Hopper GPU on CPU-only machines (it is only reached on misses and by the uncached path; with a
real GPU, pass --real-device).

Timing is ``timeit`` of a statement string with the names bound as globals, so no lambda layer is
counted. Uncached and cached runs alternate within each repeat (a load spike hits both) and the
best repeat of each is reported. Two floors are printed alongside: the bare timeit loop
(``pass``) and a call of an empty function with the predicates' signature. The cached time is
measured twice: with the very device object of the first (miss) call, and with an equal but
distinct torch.device, as ``tensor.device`` hands out a new object on every access.
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

GOAL_US = 0.15
GOAL_RATIO = 1 / 8


def empty(recipe, dtype, *, split_alignment=None, device=None):
    """Python's own floor: a call with the predicates' signature that does nothing."""
    return True


def best_us(stmts, names, calls, repeats):
    """Best per-call time (us) of each statement; the statements alternate inside every repeat."""
    timers = [timeit.Timer(s, globals=names) for s in stmts]
    best = [float("inf")] * len(stmts)
    for _ in range(repeats):
        for i, t in enumerate(timers):
            best[i] = min(best[i], t.timeit(calls) / calls * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--real-device", action="store_true")
    args = ap.parse_args()
    if args.real_device:
        index = torch.cuda.current_device()
        ctx = None
    else:
        index = 0
        ctx = S.set_capability_lookup(lambda d: (9, 0) if d.type == "cuda" else None)
        ctx.__enter__()
    device = torch.device("cuda", index)
    names = {"empty": empty, "dtype": torch.bfloat16, "device": device,
             "other_device": torch.device("cuda", index)}  # equal to `device`, not the same object

    cases = [("None (bf16)", None, 16), ("Float8Current", R.Float8CurrentScaling(), 16),
             ("MXFP8", R.MXFP8BlockScaling(), 32)]
    call = "{f}(rec, dtype, split_alignment=al, device={d})"
    names.update(rec=None, al=16)
    loop, floor = best_us(["pass", call.format(f="empty", d="device")], names, args.calls, args.repeats)
    print(f"# device={device} ({'real' if args.real_device else 'fake SM90 capability'}); best of {args.repeats} "
          f"x {args.calls} calls; load average {os.getloadavg()[0]:.2f}")
    print(f"# floors: bare timeit loop {loop:.3f} us, empty function with this signature {floor:.3f} us")
    print(f"{'predicate':<38}{'recipe':<15}{'uncached':>9}{'cached':>8}{'ratio':>7}"
          f"{'cached*':>9}{'ratio*':>7}  goals")
    for pred in (S.is_module_grouped_tensor_supported, S.is_op_fuser_grouped_tensor_supported):
        for label, rec, al in cases:
            names.update(pred=pred, unc=pred.__wrapped__, rec=rec, al=al)
            pred(rec, torch.bfloat16, split_alignment=al, device=device)  # the one miss
            unc, cac, cac_other = best_us(
                [call.format(f="unc", d="device"), call.format(f="pred", d="device"),
                 call.format(f="pred", d="other_device")],
                names, args.calls, args.repeats)
            worst = max(cac, cac_other)
            met = worst <= GOAL_US and worst / unc <= GOAL_RATIO
            print(f"{pred.__name__:<38}{label:<15}{unc:9.3f}{cac:8.3f}{cac / unc:7.3f}"
                  f"{cac_other:9.3f}{cac_other / unc:7.3f}  {'met' if met else 'NOT met'}")
    print(f"# cached* = equal but distinct torch.device object; goals: cached <= {GOAL_US} us and "
          f"<= {GOAL_RATIO:.3f} x uncached, both columns")
    routing(args)
    if ctx is not None:
        ctx.__exit__(None, None, None)


def routing(args):
    """Host time of one forward's routing decision (GroupedLinear.native_path: the recipe's state,
    the host sizes' alignment, the cached predicate with the tensor's dtype and device), with the
    sizes tuple seen before (the fused MLP's second ask, the layer's) and a new one (the step's first)."""
    from te_dist.ops import GroupedLinear

    pred = S.is_op_fuser_grouped_tensor_supported
    print(f"\n{'routing per forward':<38}{'experts':>8}{'seen sizes':>12}{'new sizes':>11}  goal <= {ROUTING_GOAL_US} us")
    for experts in (8, 64):
        for label, rec in (("Float8Block", R.Float8BlockScaling()), ("Float8Current", R.Float8CurrentScaling())):
            op = GroupedLinear(experts, 256, 256)
            op.reset_recipe_state(rec)
            x = torch.empty(experts * 128, 256)
            sizes = tuple([128] * experts)
            fresh = [tuple([128] * experts) for _ in range(args.calls // 10)]  # a new tuple per call
            names = dict(op=op, x=x, sizes=sizes, pred=pred, fresh=iter(fresh))
            seen = best_us(["op.native_path(x, sizes, pred)"], names, args.calls // 10, args.repeats)[0]
            new = float("inf")
            for _ in range(args.repeats):
                names["fresh"] = iter(fresh)
                new = min(new, timeit.Timer("op.native_path(x, next(fresh), pred)", globals=names)
                          .timeit(len(fresh)) / len(fresh) * 1e6)
            print(f"{'GroupedLinear.native_path ' + label:<38}{experts:>8}{seen:12.3f}{new:11.3f}")


ROUTING_GOAL_US = 1.0


if __name__ == "__main__":
    main()
