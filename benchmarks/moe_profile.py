"""Where one MoELayer forward+backward spends its GPU time, by kernel (single process, EP=1).

    python benchmarks/moe_profile.py --config mixtral --tokens 8192        # one H200
    python benchmarks/moe_profile.py --config deepseek --tokens 2048 --top 30

Runs ``--warmup`` steps, then profiles ``--steps`` steps with torch.profiler and prints the
kernels sorted by total CUDA time (per step), grouped into the layer's stages by name, next to
the step's wall time. It is the companion of benchmarks/moe_layer.py: that one says how far the
layer is from its grouped GEMMs, this one says which kernels make up the difference.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import te_dist as td

CONFIGS = {
    "mixtral": dict(hidden=4096, ffn=14336, experts=8, top_k=2),
    "deepseek": dict(hidden=7168, ffn=2048, experts=64, top_k=8),
    "tiny": dict(hidden=64, ffn=32, experts=8, top_k=2),
}

# Kernel-name fragments -> stage (first match wins); everything else is "other".
STAGES = (
    ("grouped gemm", ("te_gg", "cutlass", "gemm", "Kernel2", "sm90")),
    ("all-to-all", ("nccl",)),
    ("gather/scatter", ("index", "gather", "scatter")),
    ("elementwise/reduce", ("elementwise", "reduce", "vectorized", "triton")),
)


def stage_of(name: str) -> str:
    low = name.lower()
    for stage, keys in STAGES:
        if any(k.lower() in low for k in keys):
            return stage
    return "other"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="mixtral")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = CONFIGS[args.config]
    torch.manual_seed(0)
    layer = td.moe.MoELayer(cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"], dtype=dtype, device=device)
    x = torch.randn(args.tokens, cfg["hidden"], dtype=dtype, device=device, requires_grad=True)
    g = torch.randn_like(x)

    def step():
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        layer(x).backward(g)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / args.steps * 1e3

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    kernels = collections.Counter()
    calls = collections.Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name] += evt.device_time / args.steps / 1e3
            calls[evt.name] += 1
    total = sum(kernels.values())
    by_stage = collections.Counter()
    for name, ms in kernels.items():
        by_stage[stage_of(name)] += ms
    print(f"# {args.config} tokens={args.tokens} device={device} wall {wall_ms:.2f} ms/step, "
          f"kernel time {total:.2f} ms/step")
    print("| stage | ms/step | share |\n|---|---|---|")
    for stage, ms in by_stage.most_common():
        print(f"| {stage} | {ms:.3f} | {ms / max(total, 1e-9):.1%} |")
    print(f"\n| kernel (top {args.top}) | ms/step | calls/step |\n|---|---|---|")
    for name, ms in kernels.most_common(args.top):
        print(f"| {name[:110]} | {ms:.3f} | {calls[name] / args.steps:.0f} |")


if __name__ == "__main__":
    main()
