"""Grouped GEMM throughput on one GPU: our CUTLASS kernels vs torch._grouped_mm vs a per-expert loop.

    python benchmarks/grouped_gemm.py [--iters 20] [--warmup 3] [--json out.json]

Prints TFLOP/s per backend (CUTLASS per config and with the heuristic's choice), the backend the
selector picks ("auto") and its ratio to the best of the three, the CUTLASS/torch ratio and its
geometric mean over the six ANCHORS.md shapes, dgrad/wgrad rows, and the fused bias+scale epilogue
against GEMM followed by separate bias and scale kernels. Timings: CUDA events, mean of --iters
calls after --warmup calls; ratios are within this run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from te_dist import kernels  # noqa: E402
from te_dist.backends import cutlass_backend, epilogue, loop_backend, torch_backend  # noqa: E402

SHAPES = [  # name, E, rows per expert, K, N
    ("mixtral_fc1", 8, 4096, 4096, 28672),
    ("mixtral_fc2", 8, 4096, 14336, 4096),
    ("dsv3_fc1_ep8", 32, 1024, 7168, 4096),
    ("dsv3_fc2_ep8", 32, 1024, 2048, 7168),
    ("qwen3_fc1", 128, 256, 2048, 1536),
    ("small_m_E64", 64, 128, 4096, 2048),
]
DECODE = [  # name, E, total rows (spread evenly), K, N
    ("decode_E8_T64", 8, 64, 4096, 14336),
    ("decode_E64_T256", 64, 256, 2048, 1536),
]


def bench(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters  # ms


def make(E, splits, K, N, dev):
    T = sum(splits)
    x = torch.randn(T, K, device=dev).bfloat16()
    w = (torch.randn(E, N, K, device=dev) / K ** 0.5).bfloat16().transpose(1, 2)
    off = torch.tensor(splits, device=dev).cumsum(0).to(torch.int32)
    return x, w, off


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-backward", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    W, I = args.warmup, args.iters
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}, mean of {I} calls after {W} warm-up")
    results = {"forward": [], "backward": [], "epilogue": []}

    cases = [(n, E, [m] * E, K, N) for n, E, m, K, N in SHAPES]
    for n, E, T, K, N in DECODE:
        base, extra = divmod(T, E)
        cases.append((n, E, [base + (i < extra) for i in range(E)], K, N))

    hdr = f"{'shape':<16}{'cutlass':>9}{'c0 coop':>9}{'c1 pp':>9}{'torch':>9}{'loop':>9}{'auto':>9} {'pick':<8}{'auto/best':>10}{'cut/torch':>10}"
    print("\n## forward bf16 (TFLOP/s)\n" + hdr)
    geo = []
    for name, E, splits, K, N in cases:
        x, w, off = make(E, splits, K, N, dev)
        flop = 2.0 * sum(splits) * K * N
        t = {
            "cutlass": bench(lambda: cutlass_backend.forward(x, w, off), W, I),
            "c0": bench(lambda: cutlass_backend.forward(x, w, off, config=0), W, I),
            "c1": bench(lambda: cutlass_backend.forward(x, w, off, config=1), W, I),
            "torch": bench(lambda: torch_backend.forward(x, w, off), W, I),
            "loop": bench(lambda: loop_backend.forward(x, w, off), W, I),
            "auto": bench(lambda: kernels.grouped_mm_forward(x, w, off), W, I),
        }
        pick = kernels.select_backend("fwd", x, w)
        tf = {k: flop / v / 1e9 for k, v in t.items()}
        best3 = max(tf["cutlass"], tf["torch"], tf["loop"])
        ratio = tf["cutlass"] / tf["torch"]
        if name in [s[0] for s in SHAPES]:
            geo.append(ratio)
        print(f"{name:<16}{tf['cutlass']:9.1f}{tf['c0']:9.1f}{tf['c1']:9.1f}{tf['torch']:9.1f}{tf['loop']:9.1f}"
              f"{tf['auto']:9.1f} {pick:<8}{tf['auto'] / best3:10.3f}{ratio:10.3f}")
        results["forward"].append({"shape": name, "tflops": tf, "pick": pick})
        del x, w, off
        torch.cuda.empty_cache()
    gm = math.exp(sum(map(math.log, geo)) / len(geo))
    print(f"geomean cutlass/torch over the six ANCHORS shapes: {gm:.3f}")
    results["geomean_cutlass_over_torch"] = gm

    if not args.skip_backward:
        print("\n## backward bf16 (TFLOP/s)\n" + f"{'shape':<16}{'dgrad cut':>10}{'dgrad tor':>10}{'wgrad cut':>10}{'wgrad tor':>10}")
        for name, E, m, K, N in SHAPES:
            x, w, off = make(E, [m] * E, K, N, dev)
            dy = torch.randn(x.shape[0], N, device=dev).bfloat16()
            flop = 2.0 * x.shape[0] * K * N
            r = {
                "dgrad_cutlass": bench(lambda: cutlass_backend.dgrad(dy, w, off), W, I),
                "dgrad_torch": bench(lambda: torch_backend.dgrad(dy, w, off), W, I),
                "wgrad_cutlass": bench(lambda: cutlass_backend.wgrad(x, dy, off, E), W, I),
                "wgrad_torch": bench(lambda: torch_backend.wgrad(x, dy, off, E), W, I),
            }
            tf = {k: flop / v / 1e9 for k, v in r.items()}
            print(f"{name:<16}{tf['dgrad_cutlass']:10.1f}{tf['dgrad_torch']:10.1f}{tf['wgrad_cutlass']:10.1f}{tf['wgrad_torch']:10.1f}")
            results["backward"].append({"shape": name, "tflops": tf})
            del x, w, off, dy
            torch.cuda.empty_cache()

    print("\n## fused bias + row-scale epilogue (ms; ratio = unfused / fused)")
    print(f"{'shape':<16}{'fused':>9}{'cut+sep':>9}{'torch+sep':>10}{'vs cut+sep':>11}{'vs torch+sep':>13}")
    for name, E, m, K, N in SHAPES:
        x, w, off = make(E, [m] * E, K, N, dev)
        bias = torch.randn(E, N, device=dev)
        scale = torch.rand(x.shape[0], device=dev)
        fused = bench(lambda: cutlass_backend.forward(x, w, off, bias, scale), W, I)
        cut_sep = bench(lambda: epilogue.apply_epilogue(cutlass_backend.forward(x, w, off), off, bias, scale,
                                                        torch.bfloat16), W, I)
        tor_sep = bench(lambda: torch_backend.forward(x, w, off, bias, scale), W, I)
        print(f"{name:<16}{fused:9.3f}{cut_sep:9.3f}{tor_sep:10.3f}{cut_sep / fused:11.3f}{tor_sep / fused:13.3f}")
        results["epilogue"].append({"shape": name, "fused_ms": fused, "cutlass_sep_ms": cut_sep, "torch_sep_ms": tor_sep})
        del x, w, off
        torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
