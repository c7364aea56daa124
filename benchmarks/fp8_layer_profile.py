"""Where one MoELayer step's GPU time goes, per kernel category, under each recipe (torch.profiler; one GPU).

    python benchmarks/fp8_layer_profile.py [--configs deepseek,qwen3] [--recipes none,block,current] [--top 12]

Prints, per (config, recipe), the GPU time per step by category (the FP8 and bf16 GEMMs, casts,
expert-row padding, activation, permutation, router, the rest) and the --top kernels, so a gap
between the FP8 GEMMs' speed-up and the layer's is traced to the kernels that cause it.

A second table splits each step's wall time (steps queued back to back, CUDA events, outside the
profiler) into GPU busy time (the union of kernels and copies) and idle time (the profiled span less
busy: the GPU waiting for the host, chiefly after the dispatcher's one host sync per step), and gives
two ceilings of the speed over bf16: "no idle", bf16's wall over the recipe's busy time (the recipe's
own waiting gone), and "kernels", bf16's busy time over the recipe's (neither waits: what the kernels
allow). A goal above the kernels' ceiling needs faster kernels, not less host time.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import te_dist as td
from te_dist.moe import MoELayer
from te_dist.recipe import recipe_from_name

from fp8_layer import CONFIGS
from gpu_timeline import busy_span_gap

# (category, substrings of the kernel name; the first category with a match wins)
CATEGORIES = (
    ("fp8 gemm", ("te_fb", "Blockwise", "FP8Blockwise", "f8f8", "e4m3")),
    ("gemm", ("cutlass", "gemm", "Gemm", "sm90_xmma", "nvjet", "grouped_mm")),
    ("cast", ("_cast", "amax", "transpose", "cast_")),
    ("index/pad", ("index", "scatter", "gather", "repeat_interleave", "fill")),
    ("activation", ("swiglu", "silu", "sigmoid")),
    ("sort/permute", ("sort", "radix", "permute", "cumsum", "scan", "histc", "bincount")),
    ("router", ("softmax", "topk", "log_softmax", "bitonic")),
)


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def profile_one(layer, x, grad, recipe, iters):
    """({kernel: GPU ms per step}, wall ms per step, GPU busy ms per step, idle ms per step)."""
    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with td.autocast(recipe=recipe):
            y = layer(x)
        y.backward(grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        step()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    busy_us, span_us, _ = busy_span_gap(prof.events())
    per_kernel = defaultdict(float)
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t and evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.key] += t / 1000.0 / iters  # ms per step
    if not per_kernel:  # this torch names the fields differently: show its own table
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    return per_kernel, wall, busy_us / iters / 1e3, (span_us - busy_us) / iters / 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="deepseek,qwen3,mixtral")
    p.add_argument("--recipes", default="none,block,current")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    cats = [c for c, _ in CATEGORIES] + ["other"]
    summary, steps = [], []
    for name in args.configs.split(","):
        c = CONFIGS[name]
        torch.manual_seed(0)
        layer = MoELayer(c["hidden"], c["ffn"], c["experts"], c["top_k"], dtype=torch.bfloat16, device="cuda")
        x = torch.randn(c["tokens"], c["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)
        for rname in args.recipes.split(","):
            layer.fc1._weight_copy = layer.fc2._weight_copy = None
            per_kernel, wall, busy, idle = profile_one(layer, x, grad, recipe_from_name(rname), args.iters)
            by_cat = defaultdict(float)
            for k, ms in per_kernel.items():
                by_cat[category(k)] += ms
            summary.append((name, rname, by_cat))
            steps.append((name, rname, wall, busy, idle))
            print(f"\n== {name} / {rname}: GPU ms per step {sum(per_kernel.values()):.2f}")
            for k, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
                print(f"  {ms:7.3f}  [{category(k):<12}] {k[:110]}")
        del layer, x, grad
        torch.cuda.empty_cache()
    print(f"\nGPU ms per step by category ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    print(f"{'config':<9} {'recipe':<8} " + " ".join(f"{c:>12}" for c in cats) + f" {'total':>8}")
    for name, rname, by_cat in summary:
        print(f"{name:<9} {rname:<8} " + " ".join(f"{by_cat.get(c, 0.0):12.3f}" for c in cats)
              + f" {sum(by_cat.values()):8.2f}")
    print("\nStep wall time (10 steps queued back to back) against GPU busy and idle time per step; speed over bf16 "
          "as measured, with no idle (bf16 wall / recipe busy) and for the kernels (bf16 busy / recipe busy)")
    print(f"{'config':<9} {'recipe':<8} {'wall ms':>8} {'busy ms':>8} {'idle ms':>8} {'vs bf16':>8} {'no idle':>8} "
          f"{'kernels':>8}")
    bf16 = {name: (wall, busy) for name, rname, wall, busy, _ in steps if rname == "none"}
    for name, rname, wall, busy, idle in steps:
        ref_wall, ref_busy = bf16.get(name, (None, None))
        ratios = [ref_wall / wall if ref_wall else None, ref_wall / busy if ref_wall and busy else None,
                  ref_busy / busy if ref_busy and busy else None]
        print(f"{name:<9} {rname:<8} {wall:8.2f} {busy:8.2f} {idle:8.2f} "
              + " ".join(f"{r:7.2f}x" if r else f"{'-':>8}" for r in ratios))


if __name__ == "__main__":
    main()
