"""Host (CPU) time of one quantize call and of its parts, on a tensor so small the GPU never waits.

    python benchmarks/quantize_host.py            # CUDA if present, else CPU (quantizer rows only)

Why: on the H200 host the queued quantize loop of benchmarks/quantize.py is host-bound (docs/
benchmarks.md); this splits a call into what it pays for: a bare Triton launch, a CUDA allocation,
the kernel wrappers of ``triton_casts`` / ``triton_nvfp4`` and the whole ``quantizer(x)``. Each row is
the median over 5 rounds of 200 calls, queued without syncing (host time only).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from te_dist import recipe as R
from te_dist.quantization import fused_casts_available, make_quantizer

QUANTIZERS = [
    ("delayed", lambda: R.DelayedScaling(), "input", False),
    ("current", lambda: R.Float8CurrentScaling(), "input", False),
    ("block 1x128", lambda: R.Float8BlockScaling(), "input", False),
    ("block 128x128", lambda: R.Float8BlockScaling(), "weight", False),
    ("block 1x128 row+col", lambda: R.Float8BlockScaling(), "input", True),
    ("mxfp8 1x32", lambda: R.MXFP8BlockScaling(), "input", False),
    ("nvfp4 1x16", lambda: R.NVFP4BlockScaling(disable_stochastic_rounding=True), "input", False),
]


def _host_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(rounds)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    x = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    rows = []
    if device.type == "cuda" and fused_casts_available():
        from te_dist.quantization import triton_casts as tc
        from te_dist.quantization import triton_nvfp4 as nv

        out = torch.empty(256, 256, dtype=torch.float8_e4m3fn, device=device)
        codes = torch.empty(256 * 8, dtype=torch.uint8, device=device)
        rows += [
            ("bare Triton launch (_cast_rows_kernel)", lambda: tc._cast_rows_kernel[(8,)](
                x, out, codes, 2048, FMT_MAX=448.0, POWER_2=False, MX=True, EMAX=8, MARGIN=0, G=32, NB=64, ITERS=4,
                num_warps=4)),
            ("torch.empty on the device", lambda: torch.empty((256, 256), dtype=torch.float8_e4m3fn, device=device)),
            ("torch.zeros(1) on the device", lambda: torch.zeros(1, dtype=torch.int32, device=device)),
            ("wrapper cast_mxfp8", lambda: tc.cast_mxfp8(x, torch.float8_e4m3fn, 448.0, 8, 0)),
            ("wrapper current_scaling_quantize", lambda: tc.current_scaling_quantize(x, torch.float8_e4m3fn, 448.0,
                                                                                      False)),
            ("wrapper cast_nvfp4 (1x16)", lambda: nv.cast_nvfp4(x, 1, False)),
        ]
    for label, build, role, columnwise in QUANTIZERS:
        quantizer = make_quantizer(build(), role)
        quantizer.set_usage(columnwise=columnwise)
        rows.append((f"quantizer: {label}", lambda q=quantizer: q(x)))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device={name} torch={torch.__version__} x=256x256 bf16, host us per call (median of 5 x {args.calls})")
    print("| part | host us |\n|---|---|")
    for label, fn in rows:
        print(f"| {label} | {_host_us(fn, args.calls):.1f} |")


if __name__ == "__main__":
    main()
