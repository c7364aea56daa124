"""How far the fine-grained small-M forward (E64, 128 rows each, K 4096, N 2048) can go on this GPU.

    python benchmarks/small_m_roofline.py            # one H200

Why: that shape streams 1.07 GB of weights for 137 GFLOP, so it is bound by memory, not by the
tensor cores, and issue 5 asks our kernels for 1.15x ``torch._grouped_mm`` there. This turns the
GPU's own best read bandwidth, measured in the same run, into the fastest time any kernel could
take (every byte the GEMM must move, read once, at that bandwidth) and sets it against both kernels:

  * read GB/s   the fastest of several kernels that only read the weights (torch reductions, and a
                Triton streaming read where Triton is installed), and a copy (bytes read + written)
  * bound       GEMM bytes (weights + x + y) / best bandwidth, as TFLOP/s
  * torch, ours ``torch._grouped_mm`` and our CUTLASS forward (the selector's tile), TFLOP/s and the
                fraction of the bound they reach
  * one group   the same weight bytes and FLOPs as ONE group (128 rows, K 4096, N 64 x 2048): no kernel
                moves from one expert's tiles to another's, so the gap between this row and the
                grouped one is what the group switches cost (each CTA takes tiles a grid apart, so
                every tile is another expert's, with its own TMA descriptors)

If bound / torch is below 1.15, no kernel can meet the goal on this GPU. Timing: the interleaved
rounds of benchmarks/grouped_gemm.py (each sample queued behind the same dense GEMMs).
"""

from __future__ import annotations

import argparse

import torch

from grouped_gemm import bench_interleaved, make  # benchmarks/ is the script's directory

from te_dist.backends import cutlass_backend, torch_backend

E, ROWS, K, N = 64, 128, 4096, 2048


def triton_read(w_flat: torch.Tensor):
    """A streaming read of ``w_flat`` (one partial sum per program), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(STEPS):
            offs = (pid * STEPS + i) * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    block, steps = 4096, 16
    programs = triton.cdiv(w_flat.numel(), block * steps)
    out = torch.empty(programs, dtype=torch.float32, device=w_flat.device)
    return lambda: _read[(programs,)](w_flat, out, w_flat.numel(), BLOCK=block, STEPS=steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    dev = torch.device("cuda")
    x, w, off = make(E, [ROWS] * E, K, N, dev)
    w_flat = w.transpose(1, 2).contiguous().view(-1)  # the weights' bytes, contiguous
    dst = torch.empty_like(w_flat)
    w_bytes = w_flat.numel() * 2
    reads = {"sum": lambda: w_flat.sum(dtype=torch.float32), "amax": lambda: w_flat.amax()}
    streaming = triton_read(w_flat)
    if streaming is not None:
        reads["triton read"] = streaming
    x1, w1, off1 = make(1, [ROWS], K, E * N, dev)  # one group: same weight bytes and FLOPs
    config = cutlass_backend.kernels_module().choose_config("fwd", E * ROWS, N, K, E)
    fns = dict(reads, copy=lambda: dst.copy_(w_flat), torch=lambda: torch_backend.forward(x, w, off),
               ours=lambda: cutlass_backend.forward(x, w, off),
               **{"torch, one group": lambda: torch_backend.forward(x1, w1, off1),
                  "ours, one group": lambda: cutlass_backend.forward(x1, w1, off1, config=config)})
    ms = bench_interleaved(fns, args.warmup, args.iters, args.rounds)
    bw = {name: w_bytes / (ms[name] * 1e-3) / 1e9 for name in reads}
    bw["copy"] = 2 * w_bytes / (ms["copy"] * 1e-3) / 1e9
    best = max(bw.values())
    gemm_bytes = w_bytes + x.numel() * 2 + E * ROWS * N * 2
    flops = 2 * E * ROWS * K * N
    bound = flops / (gemm_bytes / (best * 1e9)) / 1e12
    tf = {name: flops / (ms[name] * 1e-3) / 1e12 for name in ("torch", "ours", "torch, one group", "ours, one group")}
    one_group_bytes = w_bytes + ROWS * K * 2 + ROWS * E * N * 2
    bound_one = flops / (one_group_bytes / (best * 1e9)) / 1e12
    print(f"\nsmall-M forward roofline, {torch.cuda.get_device_name(dev)}, E{E} x {ROWS} rows, K {K}, N {N}, bf16 "
          f"(median of {args.rounds} rounds x {args.iters} calls)")
    print("| kernel | ms | GB/s |")
    print("|---|---|---|")
    for name, gbs in bw.items():
        print(f"| {name} | {ms[name]:.4f} | {gbs:.0f} |")
    print(f"\nGEMM bytes {gemm_bytes / 1e9:.3f} GB, {flops / 1e9:.1f} GFLOP; best bandwidth {best:.0f} GB/s")
    print("| | TFLOP/s | of bound | vs torch |")
    print("|---|---|---|---|")
    print(f"| bound | {bound:.1f} | 1.00 | {bound / tf['torch']:.3f}x |")
    for name in ("torch", "ours"):
        print(f"| {name} | {tf[name]:.1f} | {tf[name] / bound:.2f} | {tf[name] / tf['torch']:.3f}x |")
    print(f"\none group (E1, {ROWS} rows, N {E * N}; tile c{config}): bytes {one_group_bytes / 1e9:.3f} GB, "
          f"bound {bound_one:.1f} TFLOP/s")
    for name in ("torch, one group", "ours, one group"):
        print(f"| {name} | {tf[name]:.1f} | {tf[name] / bound_one:.2f} | {tf[name] / tf['torch']:.3f}x |")


if __name__ == "__main__":
    main()
