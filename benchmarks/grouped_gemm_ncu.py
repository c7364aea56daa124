"""One grouped GEMM, run three times, for Nsight Compute to profile the third call.

    ncu --clock-control none --set detailed -k regex:device_kernel --launch-skip 2 --launch-count 1 \
        python benchmarks/grouped_gemm_ncu.py small_m_fwd

Cases, each a GEMM of benchmarks/grouped_gemm.py (the same shapes and, for ``--ragged`` rows, the same
group sizes at its default seed): ``small_m_fwd`` (small_m_E64: E64 x 128 rows, K 4096, N 2048, config
2), ``ds_ep2_wgrad`` (ds_ep2_1024_fc1: DeepSeek-like fc1 at EP=2 / 1024 tokens, 32 experts, ~246 rows,
config 2), ``ds_ep1_wgrad`` (ds_ep1_1024_fc1: the same at EP=1, 64 experts, ~128 rows, config 3).
``--config`` overrides the tile.
Why: the sweeps say which tile is fastest, not what bounds it; the counters say which unit is full.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from grouped_gemm import SHAPES, make, ragged_cases  # noqa: E402
from te_dist.backends import cutlass_backend  # noqa: E402

CASES = {  # name: (direction, GEMM of benchmarks/grouped_gemm.py, tile config)
    "small_m_fwd": ("fwd", "small_m_E64", 2),
    "ds_ep2_wgrad": ("wgrad", "ds_ep2_1024_fc1", 2),
    "ds_ep1_wgrad": ("wgrad", "ds_ep1_1024_fc1", 3),
}


def gemm_shape(name):
    """(groups, group sizes, K, N) of a grouped_gemm.py shape (split evenly) or --ragged GEMM."""
    even = {n: (E, [m] * E, K, N) for n, E, m, K, N in SHAPES}
    ragged = {n: (E, splits, K, N) for n, E, splits, K, N in ragged_cases()}
    return even[name] if name in even else ragged[name]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--config", type=int, default=None, help="tile config id (default: the case's)")
    args = ap.parse_args()
    direction, gemm, config = CASES[args.case]
    config = config if args.config is None else args.config
    E, splits, K, N = gemm_shape(gemm)
    dev = torch.device("cuda")
    x, w, off = make(E, splits, K, N, dev)
    if direction == "fwd":
        def call():
            return cutlass_backend.forward(x, w, off, config=config)
    else:
        dy = torch.randn(x.shape[0], N, device=dev).bfloat16()

        def call():
            return cutlass_backend.wgrad(x, dy, off, E, config=config)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    print(f"{args.case}: {direction} of {gemm}, {E} groups, {sum(splits)} rows, K {K}, N {N}, config {config}")


if __name__ == "__main__":
    main()
