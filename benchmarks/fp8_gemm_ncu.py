"""One FP8 grouped GEMM, run three times, for Nsight Compute to profile the third call.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:device_kernel \
        --launch-skip 2 --launch-count 1 python benchmarks/fp8_gemm_ncu.py dslayer_fc1 wgrad tensor

Arguments: a shape of benchmarks/fp8_grouped_gemm.py (its ragged split at the same seed), the direction
(fwd, dgrad, wgrad) and the scaling (tensor: Float8CurrentScaling HYBRID operands on the tensor-scaled
kernels; block: Float8BlockScaling). The operands are quantized before the first call (Triton kernels,
which the ``device_kernel`` filter skips). ``--config N`` forces tile config N.
Why: the sweeps say which tile is fastest, not what bounds it; the counters say which unit is full
(docs/kernels.md: the wgrad at 512 rows per expert runs at ~0.65x of fwd).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from fp8_grouped_gemm import SHAPES, splits_for  # noqa: E402
from cutlass_kernels import fp8_block  # noqa: E402
from te_dist import kernels as K  # noqa: E402
from te_dist import recipe as R  # noqa: E402
from te_dist.quantization import make_quantizer  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("direction", choices=("fwd", "dgrad", "wgrad"))
    p.add_argument("scaling", choices=("tensor", "block"))
    p.add_argument("--config", type=int, default=None)
    args = p.parse_args()
    E, rows, Kin, N = SHAPES[args.shape]
    sizes = splits_for("ragged", E, rows, torch.Generator().manual_seed(0))
    T, dev = sum(sizes), torch.device("cuda")
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    torch.manual_seed(0)
    x = torch.randn(T, Kin, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, Kin, device=dev, dtype=torch.bfloat16) / Kin ** 0.5
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    recipe = R.Float8CurrentScaling(fp8_format=R.Format.HYBRID) if args.scaling == "tensor" else R.Float8BlockScaling()
    qi, qw, qg = (make_quantizer(recipe, role) for role in ("input", "weight", "grad_output"))
    xq, dyq = qi(x, rowwise=True, columnwise=True), qg(dy, rowwise=True, columnwise=True)
    wq = K.prepare_quantized_weight(qw(w, rowwise=True, columnwise=True))
    call = {
        "fwd": lambda: K.grouped_mm_quantized_forward(xq, wq, offs, group_sizes=sizes, backend="cutlass"),
        "dgrad": lambda: K.grouped_mm_quantized_dgrad(dyq, wq, offs, group_sizes=sizes, backend="cutlass"),
        "wgrad": lambda: K.grouped_mm_quantized_wgrad(xq, dyq, offs, num_groups=E, group_sizes=sizes,
                                                      backend="cutlass"),
    }[args.direction]
    fp8_block.CONFIG_OVERRIDE = args.config
    torch.cuda.synchronize()
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    print(f"{args.shape} {args.direction} {args.scaling}: E {E}, T {T}, K {Kin}, N {N}, config "
          f"{fp8_block.choose_fp8_config(args.direction, T, E, sizes)}")


if __name__ == "__main__":
    main()
