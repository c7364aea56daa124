"""``python -m cutlass_kernels [--jobs N] [--only NAME ...]``: build every instance (the bf16 ``te_gg_*`` and FP8
``te_fb_*`` grouped GEMMs) into the cache in parallel, so a GPU run's first call pays no compilation; ``--only`` names
instances, FP8 tiles outside the default set included (e.g. ``te_fb_fwd_c8_e4m3xe4m3_bf16_tensor``).

``python -m cutlass_kernels tune --shapes FILE``: ``te-dist tune`` (``te_dist/tune.py``: the grouped-GEMM choices of
a list of shapes measured ahead of a run) in its own process, since this package imports nothing of te_dist.
"""

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from .build import BuildError, Instance, all_instances, build_instance, cache_dir
from .fp8_block import all_fp8_instances, build_fp8_instance, fp8_candidate_instances


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["tune"]:
        return subprocess.call([sys.executable, "-m", "te_dist.tune", *argv[1:]])
    ap = argparse.ArgumentParser(prog="python -m cutlass_kernels", epilog="python -m cutlass_kernels tune --shapes FILE: "
                                 "measure grouped-GEMM choices ahead of time (te-dist tune)")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--only", nargs="*", default=None, help="instance names, e.g. te_gg_fwd_c0_bf16")
    args = ap.parse_args(argv)
    if args.only is None:
        insts = all_instances() + all_fp8_instances()
    else:  # names may also pick FP8 tiles the rule does not build by default, for a sweep
        known = all_instances() + all_fp8_instances() + fp8_candidate_instances()
        insts = list({i.name: i for i in known if i.name in args.only}.values())  # a name listed twice builds once
        unknown = sorted(set(args.only) - {i.name for i in insts})
        if unknown:
            ap.error(f"no such instance: {' '.join(unknown)} (names look like te_gg_fwd_c0_bf16, "
                     f"te_fb_wgrad_c0_e4m3xe4m3_bf16_tensor)")
    print(f"building {len(insts)} instances into {cache_dir()} with {args.jobs} jobs", flush=True)
    t0 = time.time()
    failures = 0

    def one(inst):
        t = time.time()
        try:
            path = build_instance(inst) if isinstance(inst, Instance) else build_fp8_instance(inst)
            return f"ok   {inst.name} {time.time() - t:6.1f}s {path.name}"
        except BuildError as exc:
            return f"FAIL {inst.name}: {exc}"

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for line in pool.map(one, insts):
            failures += line.startswith("FAIL")
            print(line, flush=True)
    print(f"done in {time.time() - t0:.1f}s, {failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
