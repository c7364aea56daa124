"""Scaled SwiGLU backward of the grouped MLP: the Triton kernel against the compiled function.

    python benchmarks/swiglu_backward.py          # one GPU (H200 in docs/benchmarks.md)

For the activation shapes of benchmarks/moe_layer.py's rows (rows = tokens routed to this rank's
experts, F = expert FFN size), in one run: the compiled pure function (Inductor: a pointwise kernel
and a reduction), the one-pass Triton kernel of te_dist/ops/basic/swiglu_triton.py, and eager ops.
GPU time is the mean of back-to-back calls (CUDA events); bytes moved are the minimum (read h and da,
write dh and the scaled activation); host time is the CPU time to queue one call with the GPU busy.
"""

from __future__ import annotations

import argparse
import time

import torch

from te_dist.ops.basic import swiglu, swiglu_triton
from te_dist.quantization.compile import dispatch

SHAPES = (  # (name, rows, F)
    ("mixtral EP=2 2048 tok", 4096, 14336),
    ("mixtral EP=1 8192 tok", 16384, 14336),
    ("deepseek EP=2 1024 tok", 8192, 2048),
    ("deepseek EP=1 8192 tok", 65536, 2048),
)


def gpu_ms(fn, iters):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def host_us(fn, iters):
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        busy @ busy  # the GPU stays busy, so queuing never waits
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    return elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, bf16, iters {args.iters}")
    print("| shape | rows | F | compiled ms | triton ms | eager ms | triton GB/s | compiled / triton | host us compiled | host us triton |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rows, ffn in SHAPES:
        h = torch.randn(rows, 2 * ffn, device=dev, dtype=torch.bfloat16)
        da = torch.randn(rows, ffn, device=dev, dtype=torch.bfloat16)
        probs = torch.rand(rows, device=dev)
        compiled = lambda: dispatch(swiglu._scaled_swiglu_backward_kernel, da, h, probs, None)  # noqa: E731
        triton_fn = lambda: swiglu_triton.scaled_swiglu_backward(da, h, probs, None)  # noqa: E731
        eager = lambda: swiglu._scaled_swiglu_backward_eager(da, h, probs, None)  # noqa: E731
        ref, got = compiled(), triton_fn()
        for a, b in zip(ref, got):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        t_c, t_t, t_e = gpu_ms(compiled, args.iters), gpu_ms(triton_fn, args.iters), gpu_ms(eager, max(5, args.iters // 5))
        nbytes = (h.numel() + da.numel()) * 2 + (h.numel() + da.numel()) * 2 + rows * 4 * 2
        print(f"| {name} | {rows} | {ffn} | {t_c:.3f} | {t_t:.3f} | {t_e:.3f} | {nbytes / t_t / 1e6:.0f} | "
              f"{t_c / t_t:.2f} | {host_us(compiled, 50):.1f} | {host_us(triton_fn, 50):.1f} |", flush=True)
        del h, da, probs, ref, got
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
