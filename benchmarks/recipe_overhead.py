"""Per-call CPU time of a cached ``str(recipe)`` against rebuilding it, for every recipe class.

Goal (issue 2): cached read <= 0.15 us and <= 1/8 of a rebuild. Run:
    python benchmarks/recipe_overhead.py
"""

import argparse
import timeit

from te_dist import recipe as R

CLASSES = [R.DelayedScaling, R.Float8CurrentScaling, R.Float8BlockScaling, R.MXFP8BlockScaling, R.NVFP4BlockScaling]


def per_call_us(stmt, env, number, repeat):
    """Best of `repeat` runs (the least disturbed by other processes), in microseconds per call."""
    return min(timeit.repeat(stmt, globals=env, number=number, repeat=repeat)) / number * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    print(f"{'recipe':<22}{'cached us':>11}{'rebuild us':>12}{'ratio':>9}  goal")
    ok = True
    for cls in CLASSES:
        r = cls()
        r.enable_fused_grouped_mlp = True  # an attached attribute, as users do
        env = {"r": r}
        baseline = per_call_us("pass", env, args.number, args.repeat)  # loop overhead, subtracted from both
        cached = per_call_us("str(r)", env, args.number, args.repeat) - baseline
        rebuild = per_call_us("r._str_cache = None; str(r)", env, args.number // 10, args.repeat) - baseline
        meets = cached <= 0.15 and cached <= rebuild / 8
        ok &= meets
        print(f"{cls.__name__:<22}{cached:>11.3f}{rebuild:>12.3f}{rebuild / cached:>8.1f}x  {'met' if meets else 'MISSED'}")
    print("all goals met" if ok else "some goals missed")


if __name__ == "__main__":
    main()
