"""Where the GPU waits for the host in one MoELayer step: host clock against GPU clock at stage markers.

    python benchmarks/moe_stage_clock.py --config deepseek --tokens 1024                          # one GPU, EP=1
    torchrun --nproc-per-node 2 benchmarks/moe_stage_clock.py --config deepseek --tokens 1024     # EP=2, NCCL

Wraps the layer's stage functions (router, permutation, count exchange, all-to-alls, the fuser,
each grouped-GEMM call, the activation, the backward gathers). At each entry and exit it records
the host time (perf_counter) and a CUDA event. Each step starts from a synchronized GPU, so the
first marker is at 0 on both clocks.

Columns (medians over ``--steps``): ``host us`` and ``gpu us`` since the step began, ``slack`` = gpu
- host, and the deltas since the previous marker. Where slack sits near the launch latency (under
~15 us), the GPU had caught up with the host there: it was waiting for the host. The markers cost
host time of their own (~10 us each on the H200 host), so read the host deltas as upper bounds.
This is the probe that found the host work between the dispatch's host read and the first GEMM
(docs/moe.md "The host read"). benchmarks/moe_profile.py gives the kernel-level view.
"""
import argparse
import collections
import functools
import os
import time

import torch
import torch.distributed as dist

import te_dist as td
from te_dist import kernels as K
from te_dist.moe import permutation as P, router as RT
from te_dist.moe.transports import all_to_all as D
from te_dist.moe.transports.peer import dispatcher as PD
from te_dist.ops import fuser as FU
from te_dist.ops.fused import grouped_mlp as GM
from te_dist.ops.basic import grouped_linear as GL

CONFIGS = {
    "mixtral": dict(hidden=4096, ffn=14336, experts=8, top_k=2),
    "deepseek": dict(hidden=7168, ffn=2048, experts=64, top_k=8),
}

MARKS = []  # (name, host_s, event)
ON = {"on": False}


def mark(name):
    if ON["on"]:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        MARKS.append((name, time.perf_counter(), e))


def wrap(owner, attr, label=None, static=False):
    if not hasattr(owner, attr):
        return
    fn = getattr(owner, attr)
    if isinstance(owner, type) and isinstance(owner.__dict__.get(attr), staticmethod):
        static = True
    label = label or attr

    @functools.wraps(fn)
    def inner(*a, **k):
        mark(label + ">")
        try:
            return fn(*a, **k)
        finally:
            mark(label + "<")

    setattr(owner, attr, staticmethod(inner) if static else inner)


def install():
    wrap(RT.TopKRouter, "forward", "router")
    for name in ("permute_tokens", "exchange_counts", "all_to_all_tokens", "permute_rows", "unpermute_rows",
                 "unpermute_tokens", "_chunk_indices", "permute_probs", "pack_expand", "unpack_rows",
                 "sort_by_expert"):
        wrap(D, name)
    for cls in (D.AllToAllDispatcher, PD.PeerDispatcher):
        wrap(cls, "dispatch")
        wrap(cls, "combine")
    wrap(FU.OperationFuser, "forward", "fuser")
    wrap(K._Dispatch, "forward", "gemm_fwd")
    wrap(K._Dispatch, "dgrad", "gemm_dgrad")
    wrap(K._Dispatch, "wgrad", "gemm_wgrad")
    wrap(GM, "swiglu_forward")
    wrap(GM, "scaled_swiglu_backward")
    wrap(GL, "split_sizes_to_groups")
    for cls in (P._PermuteRows, P._ExpandGather, P._GatherSum):
        wrap(cls, "backward", cls.__name__ + ".bwd")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="deepseek")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_stage_clock.py needs a CUDA GPU (it reads CUDA events at every marker)")
    ep_group = None
    rank = 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        ep_group = dist.group.WORLD
        rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = CONFIGS[args.config]
    torch.manual_seed(0)
    layer = td.moe.MoELayer(cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"], ep_group=ep_group,
                            dtype=torch.bfloat16, device=dev)
    torch.manual_seed(1 + rank)
    x = torch.randn(args.tokens, cfg["hidden"], dtype=torch.bfloat16, device=dev, requires_grad=True)
    g = torch.randn_like(x)
    install()

    def step():
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        mark("step>")
        out = layer(x)
        mark("backward>")
        out.backward(g)
        mark("step<")

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    rows = collections.OrderedDict()
    walls = []
    for _ in range(args.steps):
        if ep_group is not None:
            dist.barrier()
        torch.cuda.synchronize()
        MARKS.clear()
        ON["on"] = True
        t0 = time.perf_counter()
        step()
        ON["on"] = False
        t_host = time.perf_counter() - t0
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0, t_host))
        name0, h0, e0 = MARKS[0]
        seen = collections.Counter()
        for name, h, e in MARKS:
            seen[name] += 1
            key = f"{name}#{seen[name]}"
            rows.setdefault(key, []).append(((h - h0) * 1e6, e0.elapsed_time(e) * 1e3))
    lines = [f"## rank {rank} {args.config} tokens={args.tokens} EP={dist.get_world_size() if ep_group else 1}: "
             f"wall {sum(w for w, _ in walls) / len(walls) * 1e3:.2f} ms, host {sum(h for _, h in walls) / len(walls) * 1e3:.2f} ms "
             f"(markers on: {len(MARKS)} events)",
             "| marker | host us | gpu us | slack us | host d | gpu d |", "|---|---|---|---|---|---|"]
    prev = (0.0, 0.0)
    for key, vals in rows.items():
        h = sorted(v[0] for v in vals)[len(vals) // 2]
        gg = sorted(v[1] for v in vals)[len(vals) // 2]
        lines.append(f"| {key} | {h:.0f} | {gg:.0f} | {gg - h:.0f} | {h - prev[0]:.0f} | {gg - prev[1]:.0f} |")
        prev = (h, gg)
    out = "\n".join(lines)
    if ep_group is not None:
        for r in range(dist.get_world_size()):
            if r == rank:
                print(out, flush=True)
            dist.barrier()
        dist.destroy_process_group()
    else:
        print(out, flush=True)


if __name__ == "__main__":
    main()
