"""One grouped GEMM, run three times, for Nsight Compute to profile the third call.

    ncu --clock-control none --set detailed -k regex:device_kernel --launch-skip 2 --launch-count 1 \
        python benchmarks/grouped_gemm_ncu.py small_m_fwd

Cases (shapes of benchmarks/grouped_gemm.py; ragged sizes from its router-like generator, the seed of
the matching ``--ragged`` row): ``small_m_fwd`` (E64 x 128 rows, K 4096, N 2048, config 2),
``ds_ep2_wgrad`` (DeepSeek-like fc1 wgrad at EP=2 / 1024 tokens: 32 experts, ~256 rows, config 2),
``ds_ep1_wgrad`` (the same at EP=1: 64 experts, ~128 rows, config 3). ``--config`` overrides the tile.
Why: the sweeps say which tile is fastest, not what bounds it; the counters say which unit is full.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from grouped_gemm import make, router_like_splits  # noqa: E402
from te_dist.backends import cutlass_backend  # noqa: E402

CASES = {  # name: (direction, experts, local experts or None for even 128-row groups, seed, K, N, config)
    "small_m_fwd": ("fwd", 64, None, None, 4096, 2048, 2),
    "ds_ep2_wgrad": ("wgrad", 64, 32, 104, 7168, 4096, 2),
    "ds_ep1_wgrad": ("wgrad", 64, 64, 105, 7168, 4096, 3),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--config", type=int, default=None, help="tile config id (default: the case's)")
    args = ap.parse_args()
    direction, experts, local, seed, K, N, config = CASES[args.case]
    config = config if args.config is None else args.config
    dev = torch.device("cuda")
    if local is None:
        splits = [128] * experts
    else:  # the ragged rows of a layer with `experts` experts, `local` of them on this rank, 1024 tokens, top-8
        splits = router_like_splits(seed, experts, local, experts // local * 1024 * 8)
    x, w, off = make(len(splits), splits, K, N, dev)
    if direction == "fwd":
        def call():
            return cutlass_backend.forward(x, w, off, config=config)
    else:
        dy = torch.randn(x.shape[0], N, device=dev).bfloat16()

        def call():
            return cutlass_backend.wgrad(x, dy, off, len(splits), config=config)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    print(f"{args.case}: {direction}, {len(splits)} groups, {sum(splits)} rows, K {K}, N {N}, config {config}")


if __name__ == "__main__":
    main()
