"""FP8 wgrad TFLOP/s per tile config over rows per expert (wgrad's contraction), block and tensor scales (one GPU).

    python benchmarks/fp8_wgrad_tiles.py [--configs 0,1,2,3] [--shapes ExRxKxN,...] [--labels tensor,block]

Why: wgrad contracts over each expert's rows, so at a few hundred rows per expert every output tile
runs only a few 128-long k-tiles and its epilogue is a large share of it. This times each tile config
(``cutlass_kernels.fp8_block.FP8_CONFIGS``, forced through ``CONFIG_OVERRIDE``; an instance missing
from the kernel cache is built first) on the same quantized operands with even splits, and prints
each config's TFLOP/s, its result's relative difference from the first config's, and best / first.
A shape is E x rows per expert x K (in-features) x N (out-features); block = Float8BlockScaling,
tensor = Float8CurrentScaling (HYBRID: e5m2 gradients).
"""

from __future__ import annotations

import argparse

import torch

from cutlass_kernels import fp8_block
from te_dist import kernels as K
from te_dist import recipe as R
from te_dist.quantization import make_quantizer

from fp8_grouped_gemm import bench, rel  # beside this file: the script's directory is on sys.path

SHAPES = ("64x512x7168x4096,64x512x2048x7168,32x1024x7168x4096,32x1024x2048x7168,128x512x2048x1536,"
          "128x512x768x2048,8x4096x4096x28672,8x4096x14336x4096,16x256x4096x4096,32x2048x4096x4096")


def time_configs(xq, dyq, offsets, sizes, configs, flops):
    """[(TFLOP/s, difference from the first config's result)] per config (nan where it failed)."""
    def call():
        return K.grouped_mm_quantized_wgrad(xq, dyq, offsets, num_groups=len(sizes), group_sizes=sizes,
                                            backend="cutlass")

    out, first = [], None
    for config in configs:
        fp8_block.CONFIG_OVERRIDE = config
        try:
            got = call()
            first = got if first is None else first
            out.append((flops / bench(call) / 1e9, rel(got, first)))
        except Exception as exc:  # report it, keep the table
            print(f"  config {config}: {type(exc).__name__}: {str(exc)[:200]}")
            out.append((float("nan"), float("nan")))
        finally:
            fp8_block.CONFIG_OVERRIDE = None
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="0,1,2,3")
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--labels", default="tensor,block")
    args = p.parse_args()
    configs = [int(c) for c in args.configs.split(",")]
    recipes = {"block": R.Float8BlockScaling(), "tensor": R.Float8CurrentScaling(fp8_format=R.Format.HYBRID)}
    print(f"FP8 wgrad TFLOP/s per tile config, {torch.cuda.get_device_name()} (torch {torch.__version__})")
    print("| E x rows x K x N | scales | " + " | ".join(f"c{c}" for c in configs) + f" | best / c{configs[0]} |")
    print("|---" * (len(configs) + 3) + "|")
    for shape in args.shapes.split(","):
        E, rows, k, n = map(int, shape.split("x"))
        sizes = [rows] * E
        offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(E * rows, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(E * rows, n, device="cuda", dtype=torch.bfloat16)
        for label in args.labels.split(","):
            recipe = recipes[label]
            xq = make_quantizer(recipe, "input")(x, rowwise=False, columnwise=True)
            dyq = make_quantizer(recipe, "grad_output")(dy, rowwise=False, columnwise=True)
            res = time_configs(xq, dyq, offsets, sizes, configs, 2 * E * rows * k * n)
            best = max((t for t, _ in res if t == t), default=float("nan"))
            print(f"| {shape} | {label} | " + " | ".join(f"{t:.0f} (diff {d:.0e})" for t, d in res)
                  + f" | {best / res[0][0]:.2f} |", flush=True)
        del x, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
