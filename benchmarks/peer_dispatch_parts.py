"""Where the time of one peer-rows dispatch goes, against a raw all-to-all of the same bytes.

    torchrun --nproc-per-node 2 benchmarks/peer_dispatch_parts.py          # 2xH200 (one host), bf16

Why: benchmarks/moe_layer.py reports the dispatch as one number (its ``dispatch/raw`` column). At
small token counts a dispatch is mostly fixed cost, so this splits it into its parts, each timed
back to back on its own (mean per call, max over ranks):

  * raw a2a      ``all_to_all_single`` of the rows, split sizes given on the host
  * dispatch     what moe_layer.py times: count exchange, host read, size ``x``, pull
  * exchange     the count exchange and host read alone (begin_exchange + finish_exchange)
  * pull         barrier, move, barrier, with a plan already made
  * move         the move kernel alone
  * barrier      one barrier
  * host gap     host time from the count matrix's arrival to the pull's launch (wrapped calls)

and, per config, the dispatch's kernels under torch.profiler: GPU busy time per call and the
longest idle gap between kernels (where the GPU waits for the host). Rows are random routings of
``T * top_k`` rows over the experts, as in the layer with a fresh router.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch
import torch.distributed as dist

from te_dist.moe.transports.peer.rows import begin_exchange, finish_exchange, peer_workspace, pull

from gpu_timeline import busy_span_gap  # beside this file: the script's directory is on sys.path

CONFIGS = {  # hidden, experts, top_k, token counts
    "mixtral": (4096, 8, 2, (2048, 8192)),
    "deepseek": (7168, 64, 8, (1024, 2048, 8192)),
}


def timed(fn, iters, warmup, device) -> float:
    """Mean seconds per call, max over ranks."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize(device)
    mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return float(mean)


def host_gap(ws, dispatch, iters) -> float:
    """Mean seconds from the host's wait for the count matrix returning to the pull's launch."""
    lib, marks = ws.lib, collections.defaultdict(list)
    wait, move = lib.wait_counts, lib.move

    def traced_wait(*a):
        out = wait(*a)
        marks["waited"].append(time.perf_counter())
        return out

    def traced_move(*a):
        marks["move"].append(time.perf_counter())
        return move(*a)

    lib.wait_counts, lib.move = traced_wait, traced_move
    try:
        for _ in range(iters):
            dispatch()
    finally:
        lib.wait_counts, lib.move = wait, move
    return sum(m - w for w, m in zip(marks["waited"], marks["move"])) / iters


def gpu_profile(dispatch, iters, device):
    """(GPU busy seconds per call, longest idle gap in seconds) of the dispatch's kernels and copies."""
    from torch.profiler import ProfilerActivity, profile

    dispatch()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            dispatch()
        torch.cuda.synchronize(device)
    busy, _, gap = busy_span_gap(prof.events())
    kernels = collections.defaultdict(float)  # name -> us per call
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:40]] += (e.time_range.end - e.time_range.start) / iters
    return busy / iters * 1e-6, gap * 1e-6, kernels


def run_config(name, T, args, device, rank, world):
    H, E, K, _ = CONFIGS[name]
    gen = torch.Generator(device="cpu").manual_seed(100 + rank)
    counts = torch.bincount(torch.randint(0, E, (T * K,), generator=gen), minlength=E).to(device)
    group = dist.group.WORLD
    ws = peer_workspace(group, device)
    row_bytes = H * 2
    S = T * K
    xs = torch.randn(S, H, dtype=torch.bfloat16, device=device)
    plan = begin_exchange(ws, counts, row_bytes)
    region = ws.region(S, H, torch.bfloat16)
    if region is not None:
        region.copy_(xs)
    finish_exchange(plan, staged=None if region is not None else xs)  # grows the region, copies xs in
    N = plan.num_received
    El = E // world
    recv = torch.tensor([sum(plan.matrix_row(r)[rank * El:(rank + 1) * El]) for r in range(world)])
    send = counts.view(world, El).sum(1).tolist()
    xr = torch.empty(N, H, dtype=torch.bfloat16, device=device)
    torch.cuda.synchronize(device)
    dist.barrier()

    def dispatch():
        p = begin_exchange(ws, counts, row_bytes)
        finish_exchange(p)
        pull(p, [xs.new_empty(p.num_received, H)], barrier_before=False)

    def exchange():
        finish_exchange(begin_exchange(ws, counts, row_bytes))

    parts = {
        "raw a2a": lambda: dist.all_to_all_single(xr, xs, output_split_sizes=recv.tolist(), input_split_sizes=send),
        "dispatch": dispatch,
        "exchange": exchange,
        "pull": lambda: pull(plan, [xr]),
        "move": lambda: ws.move(False, plan, [xr]),
        "barrier": ws.barrier,
    }
    row = {k: timed(fn, args.iters, args.warmup, device) for k, fn in parts.items()}
    ws.barrier()
    row["host gap"] = host_gap(ws, dispatch, args.iters)
    busy, gap, kernels = gpu_profile(dispatch, args.iters, device)
    row["gpu busy"], row["max idle"] = busy, gap
    if rank == 0 and args.kernels:
        print(f"{name} {T}: us per call by kernel: " + ", ".join(f"{k} {v:.1f}" for k, v in kernels.items()), flush=True)
    row["MB sent"] = S * row_bytes / 1e6
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="mixtral,deepseek")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--kernels", action="store_true", help="print each kernel's time per dispatch")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    cols = ["raw a2a", "dispatch", "exchange", "pull", "move", "barrier", "host gap", "gpu busy", "max idle"]
    rows = []
    try:
        for name in args.configs.split(","):
            for T in CONFIGS[name][3]:
                rows.append((name, T, run_config(name, T, args, device, rank, world)))
        if rank == 0:
            print(f"\npeer-rows dispatch parts, {world} x {torch.cuda.get_device_name(device)}, us per call "
                  f"(mean of {args.iters}, max over ranks; host gap, gpu busy and max idle: rank 0)")
            print("| config | tokens/rank | MB sent | " + " | ".join(cols) + " | dispatch/raw |")
            print("|---|---|---|" + "---|" * len(cols) + "---|")
            for name, T, r in rows:
                print(f"| {name} | {T} | {r['MB sent']:.1f} | " + " | ".join(f"{r[c] * 1e6:.1f}" for c in cols)
                      + f" | {r['raw a2a'] / r['dispatch']:.2f} |")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
