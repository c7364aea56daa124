"""Where one MoELayer forward+backward spends its GPU time, by kernel, and where the GPU waits.

    python benchmarks/moe_profile.py --config mixtral --tokens 8192        # one H200, EP=1
    python benchmarks/moe_profile.py --config deepseek --tokens 2048 --top 30
    torchrun --nproc-per-node 2 benchmarks/moe_profile.py --config deepseek --tokens 1024   # EP=2, NCCL

Runs ``--warmup`` steps, then profiles ``--steps`` steps with torch.profiler and prints the
kernels sorted by total CUDA time (per step), grouped into the layer's stages by name, next to
the step's wall time. Under torchrun the layer is expert-parallel over all ranks (NCCL) and every
rank reports, in rank order. The idle table merges every kernel interval (all streams) and lists the longest gaps in
which no kernel ran, with the kernels on either side: time the GPU spent waiting for the host.
It is the companion of benchmarks/moe_layer.py: that one says how far the layer is from its grouped
GEMMs, this one says which kernels and which waits make up the difference.

``--host N`` also runs the steps under cProfile (without torch.profiler) and prints the N functions
with the most host time of their own: what the host spends queueing a step. The header's "queued"
is the host's time per step before the final synchronize (it includes the waits in the forward's
host read); when it is close to the wall time the step is paced by the host.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist

import te_dist as td

CONFIGS = {
    "mixtral": dict(hidden=4096, ffn=14336, experts=8, top_k=2),
    "deepseek": dict(hidden=7168, ffn=2048, experts=64, top_k=8),
    "tiny": dict(hidden=64, ffn=32, experts=8, top_k=2),
}

# Kernel-name fragments -> stage (first match wins); everything else is "other".
PHASES = ("moe_forward", "moe_backward")  # our record_function ranges around one step's two halves

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
    ap.add_argument("--gaps", type=int, default=8, help="longest GPU idle gaps to list")
    ap.add_argument("--trace", default=None,
                    help="write the chrome trace here (under torchrun, one file per rank: PATH.rankN.json)")
    ap.add_argument("--loop", action="store_true",
                    help="profile the per-expert nn.Linear baseline of benchmarks/moe_layer.py instead of MoELayer")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--host", type=int, default=0, metavar="N",
                    help="also print the N functions with the most own host time under cProfile (module docstring)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    ep_group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        ep_group = dist.group.WORLD
    rank = dist.get_rank() if ep_group is not None else 0
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = CONFIGS[args.config]
    torch.manual_seed(0)
    if args.loop:
        from moe_layer import LoopMoE  # benchmarks/ is on sys.path when this file runs as a script

        layer = LoopMoE(cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"], ep_group, dtype, device)
    else:
        layer = td.moe.MoELayer(cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"], ep_group=ep_group,
                                dtype=dtype, device=device)
    torch.manual_seed(1 + rank)
    x = torch.randn(args.tokens, cfg["hidden"], dtype=dtype, device=device, requires_grad=True)
    g = torch.randn_like(x)

    def step():
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        with torch.profiler.record_function(PHASES[0]):
            out = layer(x)
        with torch.profiler.record_function(PHASES[1]):
            out.backward(g)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    queued_ms = (time.perf_counter() - t0) / args.steps * 1e3
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / args.steps * 1e3
    host_profile = None
    if args.host:
        host_profile = cProfile.Profile()
        host_profile.enable()
        for _ in range(args.steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        host_profile.disable()

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(args.trace if ep_group is None else f"{args.trace}.rank{rank}.json")
    for r in range(dist.get_world_size() if ep_group is not None else 1):  # every rank, in order
        if r == rank:
            print(f"\n## rank {rank}{' (loop baseline)' if args.loop else ''}", flush=True)
            report(prof, args, device, wall_ms, queued_ms)
            if host_profile is not None:
                print(f"host time by function, {args.steps} steps under cProfile (own time first):", flush=True)
                pstats.Stats(host_profile).sort_stats("tottime").print_stats(args.host)
        if ep_group is not None:
            dist.barrier()
    if ep_group is not None:
        dist.destroy_process_group()


def report(prof, args, device, wall_ms, queued_ms) -> None:
    kernels = collections.Counter()
    calls = collections.Counter()
    spans = []  # (start_us, end_us, name) of every kernel
    host = collections.Counter()
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            if evt.name in PHASES:
                host[evt.name] += evt.time_range.elapsed_us() / args.steps / 1e3
        elif not (getattr(evt, "is_user_annotation", False) or evt.name in PHASES):
            # (GPU copies of annotations, ours and c10d's "nccl:all_to_all", span kernels: skipped)
            kernels[evt.name] += evt.device_time / args.steps / 1e3
            calls[evt.name] += 1
            spans.append((evt.time_range.start, evt.time_range.end, evt.name))
    total = sum(kernels.values())
    by_stage = collections.Counter()
    for name, ms in kernels.items():
        by_stage[stage_of(name)] += ms
    ep = dist.get_world_size() if dist.is_initialized() else 1
    print(f"# {args.config} tokens={args.tokens} EP={ep} device={device} wall {wall_ms:.2f} ms/step "
          f"(queued {queued_ms:.2f}), kernel time {total:.2f} ms/step, host time under the profiler: forward "
          f"{host[PHASES[0]]:.2f} backward {host[PHASES[1]]:.2f} ms/step")
    print("| stage | ms/step | share |\n|---|---|---|")
    for stage, ms in by_stage.most_common():
        print(f"| {stage} | {ms:.3f} | {ms / max(total, 1e-9):.1%} |")
    print(f"\n| kernel (top {args.top}) | ms/step | calls/step |\n|---|---|---|")
    for name, ms in kernels.most_common(args.top):
        print(f"| {name[:110]} | {ms:.3f} | {calls[name] / args.steps:.0f} |")
    print_gaps(sorted(spans), args)


def print_gaps(spans, args) -> None:
    """GPU busy time (union of kernel intervals, all streams) and the longest idle gaps."""
    if not spans:
        return
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = spans[0]
    for start, end, name in spans[1:]:  # sorted by start; cur_name = the kernel that ends last so far
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_name, name))
            cur_start, cur_end, cur_name = start, end, name
        elif end >= cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    span = cur_end - spans[0][0]
    idle = sum(g for g, _, _ in gaps)
    print(f"\nGPU busy {busy / args.steps / 1e3:.2f} ms/step, idle between kernels {idle / args.steps / 1e3:.2f} "
          f"ms/step ({len(gaps) / args.steps:.0f} gaps/step; profiled span {span / args.steps / 1e3:.2f} ms/step)")
    print("| gap us | kernel before | kernel after |\n|---|---|---|")
    for gap, before, after in sorted(gaps, reverse=True)[:args.gaps]:
        print(f"| {gap:.1f} | {before[:60]} | {after[:60]} |")
    sizes = collections.Counter()
    for gap, _, _ in gaps:
        sizes["<5 us" if gap < 5 else "5-20 us" if gap < 20 else "20-100 us" if gap < 100 else ">=100 us"] += gap
    print("idle by gap size (ms/step): " + ", ".join(f"{k} {v / args.steps / 1e3:.3f}" for k, v in sizes.items()), flush=True)


if __name__ == "__main__":
    main()
