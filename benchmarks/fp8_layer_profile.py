"""Where one MoELayer step's GPU time goes, per kernel category, under each recipe (torch.profiler; one GPU).

    python benchmarks/fp8_layer_profile.py [--configs deepseek,qwen3] [--recipes none,block,current] [--top 12]
        [--host] [--gaps N] [--cprofile N]

Prints, per (config, recipe), the GPU time per step by category (the FP8 and bf16 GEMMs, casts,
expert-row padding, activation, permutation, router, the rest) and the --top kernels, so a gap
between the FP8 GEMMs' speed-up and the layer's is traced to the kernels that cause it.

A second table splits each step's wall time (steps queued back to back, CUDA events, outside the
profiler) into GPU busy time (the union of kernels and copies) and idle time (the profiled span less
busy: the GPU waiting for the host, chiefly after the dispatcher's one host sync per step), and gives
two ceilings of the speed over bf16: "no idle", bf16's wall over the recipe's busy time (the recipe's
own waiting gone), and "kernels", bf16's busy time over the recipe's (neither waits: what the kernels
allow). A goal above the kernels' ceiling needs faster kernels, not less host time.

``--host`` adds the host's side: host ms per step (the queued steps timed on the host) and the part of
it spent blocked in the step's one host read (``Tensor.tolist``, the dispatcher's); the rest is the
host's own work. A step whose host work is near its wall time is host-bound: the GPU waits for it.
``--gaps N`` prints the N longest GPU idle gaps of two profiled steps with the te_dist frames that
launched the kernel ending each gap (torch.profiler with Python stacks; the stacks slow the host, so
the gaps are longer than unprofiled), and the idle time summed per launching frame.
``--cprofile N`` runs 10 steps under cProfile and prints the N functions with the most host time of
their own, and the N te_dist functions with the most host time including their callees: where the
host's own work goes (cProfile roughly doubles it; compare rows, not absolute times).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import json
import os
import tempfile
import time
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


def make_step(layer, x, grad, recipe):
    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with td.autocast(recipe=recipe):
            y = layer(x)
        y.backward(grad)

    return step


def profile_one(step, iters):
    """({kernel: GPU ms per step}, wall ms per step, GPU busy ms per step, idle ms per step)."""
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


@contextlib.contextmanager
def host_read_clock():
    """Yields a list whose one entry accumulates the seconds spent in ``Tensor.tolist`` meanwhile."""
    spent, original = [0.0], torch.Tensor.tolist

    def timed(self):
        t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            spent[0] += time.perf_counter() - t0

    torch.Tensor.tolist = timed
    try:
        yield spent
    finally:
        torch.Tensor.tolist = original


def host_split(step, iters):
    """(host ms per step, of which blocked in host reads) for ``iters`` steps queued back to back."""
    torch.cuda.synchronize()
    with host_read_clock() as spent:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / iters * 1e3, spent[0] / iters * 1e3


def idle_gaps(step, top):
    """The ``top`` longest GPU idle gaps (> 5 µs) of two profiled steps, with the te_dist frames that
    launched the kernel ending each gap, and the idle µs summed per innermost such frame."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                 key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    frames = [e for e in events if e.get("cat") == "python_function" and "dur" in e and "te_dist" in e.get("name", "")]
    gaps, per_frame, end = [], defaultdict(float), None
    for k in gpu:
        if end is not None and k["ts"] - end > 5:
            launch = launches.get(k["args"].get("correlation"))
            stack = []
            if launch is not None:
                t, tid = launch["ts"], launch.get("tid")
                stack = [f["name"] for f in sorted((f for f in frames if f.get("tid") == tid and
                                                    f["ts"] <= t <= f["ts"] + f["dur"]), key=lambda f: f["dur"])][:3]
            per_frame[stack[0] if stack else "?"] += k["ts"] - end
            gaps.append((k["ts"] - end, k["name"][:50], " <- ".join(stack)))
        end = max(end or 0, k["ts"] + k["dur"])
    return sorted(gaps, reverse=True)[:top], sorted(per_frame.items(), key=lambda kv: -kv[1])


def host_functions(step, top):
    """cProfile of 10 queued steps: the ``top`` functions by own time, and te_dist's by cumulative time."""
    step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        step()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("te_dist", top)
    return out.getvalue()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="deepseek,qwen3,mixtral")
    p.add_argument("--recipes", default="none,block,current")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--host", action="store_true", help="add host ms per step and the part blocked in host reads")
    p.add_argument("--gaps", type=int, default=0, metavar="N", help="print the N longest GPU idle gaps and who launched")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N functions with most host time")
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
            step = make_step(layer, x, grad, recipe_from_name(rname))
            per_kernel, wall, busy, idle = profile_one(step, args.iters)
            host = host_split(step, 10) if args.host else None
            by_cat = defaultdict(float)
            for k, ms in per_kernel.items():
                by_cat[category(k)] += ms
            summary.append((name, rname, by_cat))
            steps.append((name, rname, wall, busy, idle, host))
            print(f"\n== {name} / {rname}: GPU ms per step {sum(per_kernel.values()):.2f}")
            for k, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
                print(f"  {ms:7.3f}  [{category(k):<12}] {k[:110]}")
            if args.gaps:
                gaps, per_frame = idle_gaps(step, args.gaps)
                print(f"  longest GPU idle gaps of 2 profiled steps (idle µs summed per launching frame: "
                      f"{', '.join(f'{us:.0f} {frame}' for frame, us in per_frame[:4])})")
                for us, kernel, stack in gaps:
                    print(f"  {us:8.1f} µs before {kernel} launched in {stack[:200]}")
            if args.cprofile:
                print(f"  host time by function, 10 steps under cProfile:\n{host_functions(step, args.cprofile)}")
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
          f"{'kernels':>8}" + (f" {'host ms':>8} {'in read':>8} {'host own':>8}" if args.host else ""))
    bf16 = {name: (wall, busy) for name, rname, wall, busy, _, _ in steps if rname == "none"}
    for name, rname, wall, busy, idle, host in steps:
        ref_wall, ref_busy = bf16.get(name, (None, None))
        ratios = [ref_wall / wall if ref_wall else None, ref_wall / busy if ref_wall and busy else None,
                  ref_busy / busy if ref_busy and busy else None]
        print(f"{name:<9} {rname:<8} {wall:8.2f} {busy:8.2f} {idle:8.2f} "
              + " ".join(f"{r:7.2f}x" if r else f"{'-':>8}" for r in ratios)
              + (f" {host[0]:8.2f} {host[1]:8.2f} {host[0] - host[1]:8.2f}" if host else ""))


if __name__ == "__main__":
    main()
