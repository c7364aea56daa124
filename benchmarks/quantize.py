"""Quantize throughput per recipe, against a device-to-device copy measured in the same run.

    python benchmarks/quantize.py                      # CUDA if present (8192x8192 bf16), else a tiny CPU run
    python benchmarks/quantize.py --device cpu --rows 256 --cols 512
    python benchmarks/quantize.py --eager              # without torch.compile (shows what fusion buys)
    python benchmarks/quantize.py --no-fused           # skip the fused Triton rows

Each FP8 case prints two rows on CUDA: "triton" (the fused Triton casts, ``set_fused_casts_enabled(None)``)
and "compiled" (the torch.compile'd cast functions, ``set_fused_casts_enabled(False)``); NVFP4's fused
kernels make the rowwise copy (the rows below are rowwise). "vs compiled" is the compiled time over
this row's time.

GB/s counts the bytes a quantize must move at least once: the input read plus every output
written (elements and scales). The copy baseline moves the input's bytes in and out
(``dst.copy_(src)``), so ``vs copy`` is the fraction of practical memory bandwidth reached.
"time" is a queued loop (host included: when "host" is close to it, the host is the bottleneck);
"GPU" replays the same calls from a CUDA graph (kernels only), against a graph-replayed copy.
Goal (issue 3): >= 50% of copy bandwidth for per-tensor and block formats on H200.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from te_dist import recipe as R
from te_dist.quantization import Float8Tensor, fused_casts_available, make_quantizer, set_compile_enabled
from te_dist.quantization import set_fused_casts_enabled

# recipes with a fused Triton cast (te_dist/quantization/triton_casts.py)
FUSED_RECIPES = (R.DelayedScaling, R.Float8CurrentScaling, R.Float8BlockScaling, R.MXFP8BlockScaling,
                 R.NVFP4BlockScaling)

# (label, recipe factory, role[, columnwise copy too]): one row each
CASES = [
    ("delayed (E4M3, per-tensor)", lambda: R.DelayedScaling(fp8_format=R.Format.E4M3, amax_history_len=1024), "input"),
    ("current (E4M3, per-tensor)", lambda: R.Float8CurrentScaling(fp8_format=R.Format.E4M3), "input"),
    ("current pow2 (E5M2 grad)", lambda: R.Float8CurrentScaling(use_power_2_scales=True), "grad_output"),
    ("block 1x128 (input)", lambda: R.Float8BlockScaling(), "input"),
    ("block 128x128 (weight)", lambda: R.Float8BlockScaling(), "weight"),
    ("block 1x128 row+col (input)", lambda: R.Float8BlockScaling(), "input", True),
    ("mxfp8 1x32", lambda: R.MXFP8BlockScaling(), "input"),
    ("mxfp8 1x32 row+col", lambda: R.MXFP8BlockScaling(), "input", True),
    ("nvfp4 1x16 (input, rowwise)", lambda: R.NVFP4BlockScaling(), "input"),
    ("nvfp4 16x16 (weight)", lambda: R.NVFP4BlockScaling(), "weight"),
    ("nvfp4 1x16 SR (grad)", lambda: R.NVFP4BlockScaling(), "grad_output"),
]


def _output_bytes(q) -> int:
    if isinstance(q, Float8Tensor):
        return q.data.numel() * q.data.element_size() + 4
    total = 0
    for copy in (q.rowwise, q.columnwise):
        if copy is not None:
            total += copy.data.numel() * copy.data.element_size()
            total += copy.scale_inv.numel() * copy.scale_inv.element_size()
            total += 4 if copy.global_scale_inv is not None else 0
    return total


def _time(fn, device: torch.device, warmup: int, iters: int) -> tuple:
    """(seconds per call, host seconds per call): medians over 5 rounds of ``iters`` back-to-back calls.

    On CUDA the calls of a round are queued without syncing between them, as in training where
    the host runs ahead, so the launch overhead overlaps with the previous call's kernels. The host
    time is how long queueing one call takes: when it is close to the first number, the host is the
    bottleneck, not the kernels.
    """
    for _ in range(warmup):
        fn()
    rounds, host = [], []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            host.append((time.perf_counter() - t0) / iters)
            end.record()
            end.synchronize()
            rounds.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            rounds.append((time.perf_counter() - t0) / iters)
            host.append(rounds[-1])
    return statistics.median(rounds), statistics.median(host)


def _graph_time(fn, iters: int):
    """GPU seconds per call without host overhead: ``iters`` calls captured in one CUDA graph, the
    replay timed (median of 5). None when the call cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
    except Exception as exc:  # e.g. a compiled function that recompiles under capture
        print(f"  (no CUDA graph: {exc!r:.120})")
        return None
    graph.replay()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(rounds)


def _kernel_times(fn, iters: int) -> list:
    """[(kernel name, GPU us per call)] from the torch profiler, largest first (``--profile``)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / iters) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--cols", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--eager", action="store_true", help="disable torch.compile of the cast functions")
    parser.add_argument("--compile", action="store_true", help="compile the cast functions on any device (CPU too)")
    parser.add_argument("--no-fused", action="store_true", help="skip the fused Triton rows")
    parser.add_argument("--profile", action="store_true", help="CUDA: list each case's kernels and their GPU time")
    parser.add_argument("--fused", action="store_true",
                        help="fused rows on any device (CPU: Triton's interpreter, TRITON_INTERPRET=1; logic only)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rows = args.rows or (8192 if cuda else 256)
    cols = args.cols or (8192 if cuda else 512)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 3)
    iters = args.iters if args.iters is not None else (20 if cuda else 3)
    dtype = getattr(torch, args.dtype)
    if args.eager and args.compile:
        parser.error("--eager and --compile exclude each other")
    set_compile_enabled(False if args.eager else (True if args.compile else None))

    torch.manual_seed(0)
    x = torch.randn(rows, cols, device=device, dtype=dtype)
    in_bytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    copy_s, _ = _time(lambda: dst.copy_(x), device, warmup, iters)
    copy_gbs = 2 * in_bytes / copy_s / 1e9
    copy_graph_s = _graph_time(lambda: dst.copy_(x), iters) if cuda else None

    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    mode = "torch.compile" if args.compile or (cuda and not args.eager) else "eager"
    if args.fused and args.no_fused:
        parser.error("--fused and --no-fused exclude each other")
    with_fused = (cuda or args.fused) and not args.no_fused and fused_casts_available()
    fused_on = True if args.fused else None  # None: automatic (CUDA)
    if with_fused:
        import triton

        mode += f" + fused Triton {triton.__version__}"
    print(f"device={name} torch={torch.__version__} x={rows}x{cols} {args.dtype} mode={mode} median of 5 rounds x {iters} calls")
    reference = "compiled" if mode.startswith("torch.compile") else "eager"
    print(f"| case | path | time (us) | host (us) | GB/s | vs copy | vs {reference} | GPU (us) | GPU vs copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    graph_cell = f"{copy_graph_s * 1e6:.1f} | 1.00" if copy_graph_s else " | "
    print(f"| device-to-device copy | | {copy_s * 1e6:.1f} | | {copy_gbs:.3g} | 1.00 | | {graph_cell} |")
    profiles = []
    try:
        for label, build, role, *both in CASES:
            recipe = build()
            paths = [("triton", fused_on)] if with_fused and isinstance(recipe, FUSED_RECIPES) else []
            paths.append((reference, False))
            rows_out = []
            for path, fused_setting in paths:
                set_fused_casts_enabled(fused_setting)
                quantizer = make_quantizer(recipe, role)
                quantizer.set_usage(rowwise=True, columnwise=bool(both and both[0]))
                out_bytes = _output_bytes(quantizer(x))
                seconds, host = _time(lambda: quantizer(x), device, warmup, iters)
                graph_s = _graph_time(lambda: quantizer(x), iters) if cuda else None
                rows_out.append((path, seconds, host, (in_bytes + out_bytes) / seconds / 1e9, graph_s))
                if args.profile and cuda:
                    profiles.append((f"{label} [{path}]", _kernel_times(lambda: quantizer(x), iters)))
            ref_seconds = rows_out[-1][1]
            for path, seconds, host, gbs, graph_s in rows_out:
                graph_cell = (f"{graph_s * 1e6:.1f} | {copy_graph_s / graph_s * (in_bytes + out_bytes) / (2 * in_bytes):.2f}"
                              if graph_s and copy_graph_s else " | ")
                print(f"| {label} | {path} | {seconds * 1e6:.1f} | {host * 1e6:.1f} | {gbs:.3g} | "
                      f"{gbs / copy_gbs:.2f} | {ref_seconds / seconds:.2f} | {graph_cell} |")
    finally:
        set_fused_casts_enabled(None)
    for label, kernels in profiles:
        total = sum(us for _, us in kernels)
        print(f"\n{label}: {total:.1f} us of kernels per call")
        for name, us in kernels:
            print(f"  {us:8.1f} us  {name[:110]}")


if __name__ == "__main__":
    main()
