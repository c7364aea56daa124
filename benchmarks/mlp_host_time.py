"""Host time of one fused expert-MLP forward+backward under each FP8 recipe against bf16 (one GPU).

    python benchmarks/mlp_host_time.py [--recipes current,delayed,block] [--experts 8] [--rows 256]
        [--profile delayed [--profile-dump PATH]]

Why: issue 26's bound — the quantized grouped MLP may cost at most 1.5x bf16's host time per
forward+backward (its casts are queued like the GEMMs; nothing may sync). The shapes are small
(H 256, F 256 by default) so the GPU never holds the host back: the host time to queue a step is
what is measured (``time.perf_counter`` around ``--calls`` steps queued back to back, then one sync
outside the timed region; median of ``--rounds`` rounds, rounds of the recipes interleaved so
drift hits them alike). The split sizes are given on the host, multiples of 128 (what the MoE
layer's padding hands the native path), so the native path runs with no device read. Columns: µs
per step, the ratio to bf16 in the same run, and the path the MLP took (native or emulated).
A recipe named with the suffix ``:tables`` (``current:tables``) runs its per-tensor GEMMs on the
block-scaled kernels with each scale broadcast into block tables per call: the A/B baseline of the
tensor-scaled kernels. The suffix ``:triton`` launches every Triton kernel through Triton's own
``kernel[grid](...)`` instead of ``te_dist.quantization.triton_launch`` (the A/B of those launches).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch

import te_dist as td
from te_dist.moe.expert_mlp import build_expert_mlp
from te_dist.ops import GroupSplits
from te_dist.quantization.triton_launch import TritonLaunch
from te_dist.recipe import recipe_from_name

from scale_tables import scale_tables  # beside this file: the script's directory is on sys.path


@contextlib.contextmanager
def tritons_launch(enabled: bool):
    """Inside: no launch has a key, so every Triton kernel goes through ``kernel[grid](...)``."""
    key = TritonLaunch.key
    if enabled:
        TritonLaunch.key = lambda self, grid, args, meta: None
    try:
        yield
    finally:
        TritonLaunch.key = key


def make_step(mlp, x, probs, splits, grad, name):
    base, _, option = name.partition(":")
    if option not in ("", "tables", "triton"):
        raise SystemExit(f"unknown recipe option {option!r} in {name!r} (known: tables, triton)")
    recipe = recipe_from_name(base)

    def step():  # every recipe enters the switches, so their few host µs are in every row alike
        with scale_tables(option == "tables"), tritons_launch(option == "triton"):
            mlp.zero_grad(set_to_none=True)
            x.grad = None
            with td.autocast(recipe=recipe):
                y = mlp(x, splits, probs, splits)
            y.backward(grad)
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--recipes", default="current,delayed,block")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rows", type=int, default=256, help="rows per expert (a multiple of 128)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--profile", default=None, metavar="RECIPE",
                   help="after the table, cProfile --calls steps of RECIPE and print the top 25 functions by own time")
    p.add_argument("--profile-dump", default=None, metavar="PATH",
                   help="with --profile: also write the raw profile here (read it with pstats)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: the host time of queued GPU work is what this measures")
    device = torch.device("cuda")
    torch.manual_seed(0)
    mlp = build_expert_mlp(args.experts, args.hidden, args.ffn, dtype=torch.bfloat16, device=device)
    n = args.experts * args.rows
    x = torch.randn(n, args.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(n, device=device, dtype=torch.float32)
    grad = torch.randn(n, args.hidden, device=device, dtype=torch.bfloat16)
    sizes = (args.rows,) * args.experts
    splits = GroupSplits(torch.tensor(sizes, device=device).cumsum(0).to(torch.int32), sizes)
    names = ["none"] + [r for r in args.recipes.split(",") if r and r != "none"]
    mlps = {name: copy.deepcopy(mlp) for name in names}  # one per recipe: each keeps its quantizer state
    steps = {name: make_step(mlps[name], x, probs, splits, grad, name) for name in names}
    for step in steps.values():  # warm up: kernels built and loaded, weight copies cast, plans made
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    times = {name: [] for name in names}
    for _ in range(args.rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                step()
            times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
            torch.cuda.synchronize()
    base = statistics.median(times["none"])
    print(f"expert MLP forward+backward, {args.experts} experts x {args.rows} rows, H {args.hidden}, F {args.ffn}, "
          f"bf16; host µs per step (median of {args.rounds} rounds of {args.calls}); {torch.cuda.get_device_name()}")
    print("| recipe | host µs / step | vs bf16 | path |")
    print("|---|---|---|---|")
    for name in names:
        us = statistics.median(times[name])
        path = "-" if name == "none" else ("native" if mlps[name].basic_ops[0].has_native_weight_copy else "emulated")
        print(f"| {name} | {us:.1f} | {us / base:.2f}x | {path} |")
    if args.profile:  # where the host time goes (what the table cannot say)
        import cProfile
        import pstats

        step = make_step(mlps[args.profile], x, probs, splits, grad, args.profile)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        if args.profile_dump:
            profiler.dump_stats(args.profile_dump)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
