"""How far the fine-grained small-M forward (E64, 128 rows each, K 4096, N 2048) can go on this GPU.

    python benchmarks/small_m_roofline.py            # one H200

Why: that shape streams 1.07 GB of weights for 137 GFLOP, so it is bound by memory, not by the
tensor cores, and issue 5 asks our kernels for 1.15x ``torch._grouped_mm`` there. This turns the
GPU's own best read bandwidth, measured in the same run, into the fastest time any kernel could
take (every byte the GEMM must move, read once, at that bandwidth) and sets it against both kernels:

  * read GB/s   the fastest of several kernels that only read the weights (torch reductions, and a
                Triton streaming read where Triton is installed), and a copy (bytes read + written);
                the "GEMM order" reads walk each slab of 64 or 128 weight rows 64-256 columns at a
                time, as a K-major tile's mainloop does (ours: 128 rows x 64), so the gap to the
                contiguous read is what that access pattern costs before any math
  * bound       GEMM bytes (weights + x + y) / best bandwidth, as TFLOP/s; also at the bandwidth of
                our tile's own read pattern, and the goal (1.15x torch) as a fraction of the bound
  * torch, ours ``torch._grouped_mm`` and our CUTLASS forward (the selector's tile), TFLOP/s and the
                fraction of the bound they reach
  * ours cN     with --tiles: our forward on tile N (cutlass_kernels.TILES), to compare tiles against
                the same bound
  * one group   the same weight bytes and FLOPs as ONE group (128 rows, K 4096, N 64 x 2048): no kernel
                moves from one expert's tiles to another's, so the gap between this row and the
                grouped one is what the group switches cost (each CTA takes tiles a grid apart, so
                every tile is another expert's, with its own TMA descriptors); cuBLAS times that
                one GEMM as a dense ``torch.mm``, the best any library kernel does with this access

If bound / torch is below 1.15, no kernel can meet the goal on this GPU. Timing: the interleaved
rounds of benchmarks/grouped_gemm.py (each sample queued behind the same dense GEMMs).
"""

from __future__ import annotations

import argparse

import torch

from grouped_gemm import bench_interleaved, make  # benchmarks/ is the script's directory

from te_dist.backends import cutlass_backend, torch_backend

E, ROWS, K, N = 64, 128, 4096, 2048
# (rows, columns per step) of the "GEMM order" reads: our tile's 128 x 64 (c2), and longer runs per
# row; 128 x 256 is left out (its Triton accumulator does not fit in registers, so it would measure
# spills, not the pattern).
PATTERNS = ((128, 64), (128, 128), (64, 128), (64, 256))


def pattern_name(rows: int, k_step: int) -> str:
    return f"triton read, GEMM order ({rows} rows x {k_step})"


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


def triton_tile_read(w_flat: torch.Tensor, rows: int, k: int, k_step: int):
    """A read of the weights in the order the GEMM's mainloop reads them: one program per ``rows`` x
    ``k`` slab (one N tile of one expert), ``k_step`` columns of all its rows per step. Against the
    contiguous read this says what the access pattern alone costs. Needs Triton (main() calls it
    only where ``triton_read`` found it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x_ptr, out_ptr, ROWS: tl.constexpr, KLEN: tl.constexpr, KSTEP: tl.constexpr):
        pid = tl.program_id(0)
        base = x_ptr + pid * ROWS * KLEN
        r = tl.arange(0, ROWS)[:, None]
        c = tl.arange(0, KSTEP)[None, :]
        acc = tl.zeros([ROWS, KSTEP], dtype=tl.float32)
        for k0 in range(0, KLEN, KSTEP):
            acc += tl.load(base + r * KLEN + k0 + c).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))

    programs = w_flat.numel() // (rows * k)
    out = torch.empty(programs, dtype=torch.float32, device=w_flat.device)
    return lambda: _read[(programs,)](w_flat, out, ROWS=rows, KLEN=k, KSTEP=k_step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tiles", default="",
                    help="comma-separated tile ids (cutlass_kernels.TILES) to time as well, e.g. 10,6")
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
        for rows, k_step in PATTERNS:
            reads[pattern_name(rows, k_step)] = triton_tile_read(w_flat, rows, K, k_step)
    x1, w1, off1 = make(1, [ROWS], K, E * N, dev)  # one group: same weight bytes and FLOPs
    config = cutlass_backend.kernels_module().choose_config("fwd", E * ROWS, N, K, E)
    fns = dict(reads, copy=lambda: dst.copy_(w_flat), torch=lambda: torch_backend.forward(x, w, off),
               ours=lambda: cutlass_backend.forward(x, w, off),
               **{"torch, one group": lambda: torch_backend.forward(x1, w1, off1),
                  "ours, one group": lambda: cutlass_backend.forward(x1, w1, off1, config=config),
                  "cuBLAS, one group": lambda: torch.mm(x1, w1[0])})
    tiles = [int(t) for t in args.tiles.split(",") if t]
    for t in tiles:
        fns[f"ours c{t}"] = lambda t=t: cutlass_backend.forward(x, w, off, config=t)
    ms = bench_interleaved(fns, args.warmup, args.iters, args.rounds)
    bw = {name: w_bytes / (ms[name] * 1e-3) / 1e9 for name in reads}
    bw["copy"] = 2 * w_bytes / (ms["copy"] * 1e-3) / 1e9
    best = max(bw.values())
    gemm_bytes = w_bytes + x.numel() * 2 + E * ROWS * N * 2
    flops = 2 * E * ROWS * K * N
    bound = flops / (gemm_bytes / (best * 1e9)) / 1e12
    gemms = ("torch", "ours", *(f"ours c{t}" for t in tiles))
    one_group = ("torch, one group", "ours, one group", "cuBLAS, one group")
    tf = {name: flops / (ms[name] * 1e-3) / 1e12 for name in gemms + one_group}
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
    ours_pattern = pattern_name(128, 64)
    if ours_pattern in bw:
        tile_bound = flops / (gemm_bytes / (bw[ours_pattern] * 1e9)) / 1e12
        print(f"| bound at our tile's read pattern (128 rows x 64) | {tile_bound:.1f} | {tile_bound / bound:.2f} | "
              f"{tile_bound / tf['torch']:.3f}x |")
    goal = 1.15 * tf["torch"]
    print(f"| goal (1.15x torch) | {goal:.1f} | {goal / bound:.3f} | 1.150x |")
    for name in gemms:
        print(f"| {name} | {tf[name]:.1f} | {tf[name] / bound:.2f} | {tf[name] / tf['torch']:.3f}x |")
    print(f"\none group (E1, {ROWS} rows, N {E * N}; tile c{config}): bytes {one_group_bytes / 1e9:.3f} GB, "
          f"bound {bound_one:.1f} TFLOP/s")
    for name in one_group:
        print(f"| {name} | {tf[name]:.1f} | {tf[name] / bound_one:.2f} | {tf[name] / tf['torch']:.3f}x |")


if __name__ == "__main__":
    main()
