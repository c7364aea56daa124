"""MoE layer forward+backward at EP=1 and EP=world, against a per-expert nn.Linear loop, in one run.

    torchrun --nproc-per-node 2 benchmarks/moe_layer.py --backend nccl          # 2xH200, bf16
    torchrun --nproc-per-node 2 benchmarks/moe_layer.py --backend gloo --tiny   # CPU check, fp32

Rows of the table (one per model config and EP size; times are the max over ranks of the mean
of ``--iters`` steps after ``--warmup``):
  * layer        MoELayer forward+backward (router, permute, all-to-alls, fused grouped MLP).
  * loop         the same router/dispatcher with experts as a Python loop over torch.nn.Linear
                 (Megatron-Core SequentialMLP's approach); speedup = loop / layer.
  * gemm         the layer's six grouped GEMMs alone (fc1/fc2 forward, dgrad, wgrad) on the split
                 sizes of the layer's last step.
  * a2a          raw ``all_to_all_single`` calls alone for the same token moves (dispatch and
                 combine, forward and backward; the probabilities in the dispatch's rows where the
                 dispatcher packs them, te_dist.moe.payload, else one more call); 0 at EP=1.
  * overhead     layer / (gemm + a2a); the goal is <= 1.3.
  * dispatch     the layer's dispatch move against a raw ``all_to_all_single`` of the same bytes, as
                 algorithm bandwidth (bytes sent per rank / time). With the peer-rows transport
                 (te_dist.moe.transports.peer, the default on the GPUs of one host): count
                 exchange, row map, host read of the counts, pull of the received rows from the
                 senders' regions; with the all-to-all transport: count exchange + host read + variable-split
                 token all-to-all (column "a2a dispatch/raw", measured in both cases).
  * layer a2a    the layer step again with te_dist.settings.ep_transport="all_to_all" (the NCCL all-to-all transport),
                 in the same process right after the default one; EP>1 only.
  * in step      the whole ``dispatcher.dispatch`` (permutation, count exchange, host read, token
                 (and probability) all-to-alls, sort by local expert; with peer rows: permutation,
                 the peer dispatch) against the all-to-all work done by an oracle
                 that knows the split sizes in advance (no count exchange, no host read, sort index
                 precomputed): oracle time / dispatch time, calls back to back. The
                 dispatcher builds its sort indices before its host read, where in a layer step they
                 run behind the previous work; back to back nothing hides them, so this column
                 charges them in full.
Tokens/s is per rank (tokens of this rank's batch / layer step time). Each config runs 8192 and 2048
tokens per rank by default, DeepSeek-like also 1024 (``--tokens`` to change): fewer tokens per expert is where a per-expert
loop loses most (launch overhead, small GEMMs).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import timing  # noqa: I001 - first: this checkout's te_dist on the path
import te_dist as td
from te_dist import kernels
from te_dist.gemm import cutlass_backend
from te_dist.distributed import exchange_counts
from te_dist.distributed.all_to_all import all_to_all_tokens
from te_dist.moe import TopKRouter, TransportSelector
from te_dist.moe.transports.peer.rows import begin_exchange, finish_exchange, peer_workspace, pull
from te_dist.moe.payload import pack_expand, payload_columns, unpack_rows
from te_dist.moe.permutation import chunk_sort_index, permute_probs, permute_tokens, sort_by_expert

CONFIGS = {
    "mixtral": dict(hidden=4096, ffn=14336, experts=8, top_k=2, tokens=[8192, 2048]),
    "deepseek": dict(hidden=7168, ffn=2048, experts=64, top_k=8, tokens=[8192, 2048, 1024]),
}
TINY = {
    "mixtral": dict(hidden=64, ffn=224, experts=8, top_k=2, tokens=[256]),
    "deepseek": dict(hidden=112, ffn=32, experts=64, top_k=8, tokens=[128]),
}


class LoopMoE(nn.Module):
    """Baseline: the layer's router and dispatcher, experts run one by one as nn.Linear pairs."""

    def __init__(self, hidden, ffn, num_experts, top_k, ep_group, dtype, device):
        super().__init__()
        self.router = TopKRouter(hidden, num_experts, top_k, dtype=dtype, device=device)
        self.dispatcher = TransportSelector(num_experts, ep_group)  # the layer's transport (auto)
        El = self.dispatcher.num_local_experts
        self.fc1 = nn.ModuleList(nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype, device=device) for _ in range(El))
        self.fc2 = nn.ModuleList(nn.Linear(ffn, hidden, bias=False, dtype=dtype, device=device) for _ in range(El))

    def forward(self, x):
        routing = self.router(x, check_finite=False)
        x_NH, splits, probs_N, state = self.dispatcher.dispatch(x, routing.probs_TK, routing.indices_TK, probs_in_expert=True)
        sizes = splits.tolist()
        outs = []
        for fc1, fc2, xe, pe in zip(self.fc1, self.fc2, x_NH.split(sizes), probs_N.split(sizes)):
            gate, up = fc1(xe).chunk(2, dim=-1)
            outs.append(fc2(F.silu(gate) * up * pe.to(xe.dtype).unsqueeze(-1)))
        return self.dispatcher.combine(torch.cat(outs), state)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, args, device) -> float:
    """Mean seconds per call, max over ranks (a step is as slow as its slowest rank)."""
    return timed_ranks(fn, args, device)[0]


def timed_ranks(fn, args, device):
    """(max, min) over ranks of the mean seconds per call."""
    for _ in range(args.warmup):
        fn()
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        fn()
    sync(device)
    mean = (time.perf_counter() - start) / args.iters
    elapsed = torch.tensor([mean, -mean], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed[0]), -float(elapsed[1])


def train_step(module, x, g):
    for p in module.parameters():
        p.grad = None
    x.grad = None
    module(x).backward(g)


def offsets_of(splits, device):
    return torch.cumsum(splits.to(device), 0, dtype=torch.int32)


def gemm_fn(layer, splits, dtype, device):
    """The layer's six grouped GEMMs on its own weights and last split sizes (given on the host, as the layer does)."""
    H, Fd = layer.hidden_size, layer.ffn_hidden_size
    N = int(splits.sum())
    off = offsets_of(splits, device)
    w1, w2 = layer.fc1.weight.detach().transpose(1, 2), layer.fc2.weight.detach().transpose(1, 2)
    x = torch.randn(N, H, dtype=dtype, device=device)
    s = torch.randn(N, Fd, dtype=dtype, device=device)
    dy = torch.randn(N, H, dtype=dtype, device=device)
    dh = torch.randn(N, 2 * Fd, dtype=dtype, device=device)
    E = layer.num_local_experts
    sizes = splits.tolist()  # on the host, as the layer hands them to its GEMMs

    def run():
        kernels.grouped_mm_forward(x, w1, off, group_sizes=sizes)
        kernels.grouped_mm_forward(s, w2, off, group_sizes=sizes)
        kernels.grouped_mm_dgrad(dy, w2, off, group_sizes=sizes)
        kernels.grouped_mm_wgrad(s, dy, off, num_groups=E, group_sizes=sizes)
        kernels.grouped_mm_dgrad(dh, w1, off, group_sizes=sizes)
        kernels.grouped_mm_wgrad(x, dh, off, num_groups=E, group_sizes=sizes)

    return run


def gemm_backends(layer, splits, dtype, device) -> str:
    """What the layer's six GEMMs run on for these split sizes, forward/dgrad/wgrad per linear, e.g.
    "fc1 c10/loop/c2, fc2 loop/c10/c2" (cN: our CUTLASS kernels with tile config N)."""
    sizes = splits.tolist()
    rows = torch.empty(sum(sizes), 0, dtype=dtype, device=device)  # only rows, dtype and device are read
    choose_config = cutlass_backend.kernels_module().choose_config
    out = []
    for name, w in (("fc1", layer.fc1.weight), ("fc2", layer.fc2.weight)):
        w_EKN = w.detach().transpose(1, 2)
        E, K, N = w_EKN.shape
        picks = []
        for direction in ("fwd", "dgrad", "wgrad"):
            pick = kernels.select_backend(direction, rows, w_EKN, group_sizes=sizes)
            if pick == "cutlass":
                pick = f"c{choose_config(direction, sum(sizes), N, K, E, group_sizes=sizes)}"
            picks.append(pick)
        out.append(f"{name} {'/'.join(picks)}")
    return ", ".join(out)


def a2a_splits(layer):
    """(input_splits, output_splits) of the layer's last dispatch."""
    R = layer.ep_size
    counts = layer.tokens_per_expert
    recv = exchange_counts(counts, layer.ep_group)
    return counts.view(R, -1).sum(1).tolist(), recv.view(R, -1).sum(1).tolist()


def raw_a2a(x, out_splits, in_splits, group):
    out = x.new_empty((sum(out_splits), x.shape[1]) if x.dim() == 2 else (sum(out_splits),))
    dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return out


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def batch(T, H, dtype, device):
    gen = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    x = torch.randn(T, H, dtype=dtype, device=device, generator=gen).requires_grad_(True)
    return x, torch.randn(T, H, dtype=dtype, device=device, generator=gen)


def with_transport(name, fn):
    """``fn`` run with ``te_dist.settings.ep_transport`` = name (read at every dispatch; the same on every rank)."""
    def run():
        with td.settings.override(ep_transport=name):
            return fn()
    return run


def bench_layer_parts(layer, T, args, device, dtype):
    """Layer step, its grouped GEMMs alone, raw all-to-alls alone, dispatch bandwidth, for T tokens."""
    H, group = layer.hidden_size, layer.ep_group
    x, g = batch(T, H, dtype, device)
    t_layer, t_layer_min = timed_ranks(functools.partial(train_step, layer, x, g), args, device)
    splits = layer.tokens_per_local_expert
    backend = gemm_backends(layer, splits, dtype, device)
    t_gemm, t_gemm_min = timed_ranks(gemm_fn(layer, splits, dtype, device), args, device)
    t_a2a = t_ours = t_ours_a2a = t_raw = t_step = t_oracle = t_layer_a2a = 0.0
    sent_bytes = 0
    transport = layer.dispatcher.transport
    if layer.ep_size > 1:
        t_layer_a2a = timed(with_transport("all_to_all", functools.partial(train_step, layer, x, g)), args, device)
        in_splits, out_splits = a2a_splits(layer)
        xs = torch.randn(sum(in_splits), H, dtype=dtype, device=device)
        xr = torch.randn(sum(out_splits), H, dtype=dtype, device=device)
        ps = torch.rand(sum(in_splits), dtype=torch.float32, device=device)
        # The layer's own moves: where the dispatcher packs the probabilities into the token rows
        # (te_dist.moe.payload), its dispatch and dispatch backward move payload rows, and no
        # separate probability all-to-all runs.
        packed = layer.num_local_experts > 1 and layer.probs_position == "expert"
        cols = payload_columns(H, dtype) if packed else H
        pay_s = torch.randn(sum(in_splits), cols, dtype=dtype, device=device)
        pay_r = torch.randn(sum(out_splits), cols, dtype=dtype, device=device)

        def raw_all():
            raw_a2a(pay_s, out_splits, in_splits, group)  # dispatch
            if not packed:
                raw_a2a(ps, out_splits, in_splits, group)  # probabilities
            raw_a2a(xr, in_splits, out_splits, group)  # combine
            raw_a2a(xs, out_splits, in_splits, group)  # combine backward (same direction as dispatch)
            raw_a2a(pay_r, in_splits, out_splits, group)  # dispatch backward

        t_a2a = timed(raw_all, args, device)
        counts = layer.tokens_per_expert

        def ours_a2a():
            recv = exchange_counts(counts, group)
            torch.cat([counts, recv]).tolist()
            all_to_all_tokens(xs, out_splits, in_splits, group)

        t_ours_a2a = t_ours = timed(ours_a2a, args, device)
        if transport == "peer":  # the rows sit in the senders' regions, where the expand gather writes them
            ws = peer_workspace(group, device)

            def ours_peer():
                plan = begin_exchange(ws, counts, H * xs.element_size())
                finish_exchange(plan)
                pull(plan, [xs.new_empty(plan.num_received, H)], barrier_before=False)

            t_ours = timed(ours_peer, args, device)
        t_raw = timed(lambda: raw_a2a(xs, out_splits, in_splits, group), args, device)
        sent_bytes = xs.numel() * xs.element_size()
        t_step, t_oracle = in_step_dispatch(layer, x.detach(), args, device)
    return dict(
        tokens=T, backend=backend, transport=transport, layer_a2a_ms=t_layer_a2a * 1e3, layer_ms=t_layer * 1e3, layer_min_ms=t_layer_min * 1e3, gemm_min_ms=t_gemm_min * 1e3, tok_s=T / t_layer, gemm_ms=t_gemm * 1e3,
        a2a_ms=t_a2a * 1e3, overhead=t_layer / (t_gemm + t_a2a),
        ours_gbs=sent_bytes / t_ours / 1e9 if t_ours else float("nan"),
        raw_gbs=sent_bytes / t_raw / 1e9 if t_raw else float("nan"),
        a2a_ratio=t_raw / t_ours if t_ours else float("nan"),
        nccl_ratio=t_raw / t_ours_a2a if t_ours_a2a else float("nan"),
        step_ratio=t_oracle / t_step if t_step else float("nan"),
    )


@torch.no_grad()
def in_step_dispatch(layer, x, args, device):
    """(dispatch, oracle) seconds: ``dispatcher.dispatch`` as the layer calls it, and the same
    permutation, all-to-alls and local-expert sort with the split sizes known in advance."""
    group, disp = layer.ep_group, layer.dispatcher
    routing = layer.router(x, check_finite=False)
    probs, indices = routing.probs_TK, routing.indices_TK
    _, perm = permute_tokens(x, indices, layer.num_experts)
    recv = exchange_counts(perm.counts_E, group)
    in_splits = perm.counts_E.view(layer.ep_size, -1).sum(1).tolist()
    out_splits = recv.view(layer.ep_size, -1).sum(1).tolist()
    chunk = chunk_sort_index(recv.view(layer.ep_size, -1), sum(out_splits)) if layer.num_local_experts > 1 else None

    def ours():
        disp.dispatch(x, probs, indices, probs_in_expert=True)

    def oracle():
        if chunk is not None:  # packed, as the dispatcher does it here (te_dist.moe.payload)
            p = sort_by_expert(x, indices, layer.num_experts)
            payload = raw_a2a(pack_expand(x, permute_probs(probs, p), p), out_splits, in_splits, group)
            unpack_rows(payload, chunk, chunk, x.shape[1], probs.dtype)
            return
        x_SH, p = permute_tokens(x, indices, layer.num_experts)
        raw_a2a(x_SH, out_splits, in_splits, group)
        raw_a2a(permute_probs(probs, p), out_splits, in_splits, group)

    return timed(ours, args, device), timed(oracle, args, device)


def bench_config(name, cfg, ep_size, tokens_list, args, device, dtype, rows):
    """One model config at one EP size, every token count: the layer first, then the loop baseline."""
    group = dist.group.WORLD if ep_size > 1 else None
    shape = (cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"])
    torch.manual_seed(0)
    layer = td.moe.MoELayer(*shape, ep_group=group, dtype=dtype, device=device)
    new_rows = [dict(config=name, ep=ep_size, **bench_layer_parts(layer, T, args, device, dtype)) for T in tokens_list]
    del layer
    free(device)
    torch.manual_seed(0)
    loop = LoopMoE(*shape, group, dtype, device)
    for row in new_rows:
        x, g = batch(row["tokens"], cfg["hidden"], dtype, device)
        t_loop, t_loop_min = timed_ranks(functools.partial(train_step, loop, x, g), args, device)
        row["loop_ms"], row["loop_min_ms"] = t_loop * 1e3, t_loop_min * 1e3
        row["speedup"] = row["loop_ms"] / row["layer_ms"]
        if dist.get_rank() == 0:
            print(f"done {name} EP={ep_size} tokens={row['tokens']}: slowest/fastest rank: layer {row['layer_ms']:.2f}/"
                  f"{row['layer_min_ms']:.2f} ms, loop {row['loop_ms']:.2f}/{row['loop_min_ms']:.2f} ms, gemm "
                  f"{row['gemm_ms']:.2f}/{row['gemm_min_ms']:.2f} ms", flush=True)
    del loop
    free(device)
    rows.extend(new_rows)


def print_table(rows, header):
    cols = [("config", "{}"), ("ep", "{}"), ("tokens", "{}"), ("backend", "{}"), ("transport", "{}"), ("layer_ms", "{:.2f}"),
            ("layer_a2a_ms", "{:.2f}"), ("loop_ms", "{:.2f}"), ("speedup", "{:.2f}x"),
            ("tok_s", "{:,.0f}"), ("gemm_ms", "{:.2f}"), ("a2a_ms", "{:.2f}"), ("overhead", "{:.2f}x"),
            ("ours_gbs", "{:.1f}"), ("raw_gbs", "{:.1f}"), ("a2a_ratio", "{:.2f}"), ("nccl_ratio", "{:.2f}"), ("step_ratio", "{:.2f}")]
    names = ["config", "EP", "tokens/rank", "GEMM backends", "transport", "layer ms", "layer ms, a2a transport", "loop ms", "vs loop",
             "tokens/s/rank", "gemm ms", "raw a2a ms", "layer/(gemm+a2a)", "dispatch GB/s", "raw a2a GB/s", "dispatch/raw",
             "a2a dispatch/raw", "in step: oracle/dispatch"]
    print(header)
    print("| " + " | ".join(names) + " |")
    print("|" + "---|" * len(names))
    for r in rows:
        print("| " + " | ".join(fmt.format(r[c]) for c, fmt in cols) + " |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU check of the whole script)")
    parser.add_argument("--configs", default="mixtral,deepseek")
    parser.add_argument("--tokens", default=None,
                        help="comma-separated tokens per rank (default: the config's list)")
    parser.add_argument("--ep-sizes", default=None, help="comma-separated EP sizes (default: 1 and the world size)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the rows as JSON (rank 0; benchmarks/plots.py reads it)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    dist.init_process_group(args.backend)
    world = dist.get_world_size()
    table = TINY if args.tiny else CONFIGS
    rows = []
    try:
        for name in args.configs.split(","):
            cfg = table[name]
            tokens_list = [int(t) for t in args.tokens.split(",")] if args.tokens else cfg["tokens"]
            ep_sizes = [int(e) for e in args.ep_sizes.split(",")] if args.ep_sizes else sorted({1, world})
            for ep_size in ep_sizes:
                bench_config(name, cfg, ep_size, tokens_list, args, device, dtype, rows)
        if dist.get_rank() == 0:
            hw = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
            print_table(rows, f"\nMoE layer fwd+bwd, {world} rank(s) x {hw}, {dtype}, {args.backend}, "
                              f"torch {torch.__version__}, iters {args.iters} warmup {args.warmup}")
            timing.write_json(args.json, rows, hardware=f"{world} x {hw}", dtype=str(dtype), backend=args.backend,
                              benchmark="moe_layer")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
