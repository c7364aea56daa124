"""When an FP8 grouped GEMM runs as cuBLAS per expert (``fp8_loop_backend``) instead of our grouped
kernels (``fp8_cutlass_backend``): a rule on host-side facts only (no launches, no env reads).

| backend  | when (first row that holds wins) |
|---|---|
| forced   | ``backend=`` given: used if it can run, else ValueError saying why |
| emulated | the grouped kernels cannot run the call (kernels.py ``_quantized_why_not``) |
| loop     | the grouped kernels could, and: the group sizes are on the host, not capturing a CUDA graph, bf16 out, no fused epilogue (bias, row scale), for block scales e4m3 operands and (fwd, dgrad) a contraction that is a multiple of 512, and each expert's GEMM is at least ``LOOP_MIN_FLOP_PER_EXPERT`` (per-tensor scales) or ``LOOP_MIN_FLOP_PER_EXPERT_BLOCK`` on average |
| cutlass  | otherwise |

The thresholds are measured on the H200 (`python benchmarks/fp8_ceiling.py` and
`benchmarks/fp8_grouped_gemm.py`, docs/kernels.md "FP8 grouped GEMMs"; two runs). Per-tensor scales:
cuBLAS per expert beat the grouped kernels in every direction from 30 GFLOP per expert GEMM up
(DeepSeek-like fc1 with 512 rows: 1.04-1.13x; 1.05-1.34x at 60-240) and lost at 15 (its fc2:
0.82-1.09x: launches and short GEMMs' tails). Block scales: 1.04-1.20x at 120-240 GFLOP
(Mixtral-like, 1024 rows per expert), 0.96-1.09x at 60 (DeepSeek-V3 fc1, 1024 rows). The thresholds
keep a margin over the last even point; a GEMM of 50 GFLOP runs ~45 us, longer than its launch.
Newer torch asks for 128x128 scale tables with rows padded to 4 entries; with a contraction of 256 cuBLAS
refused the call (fwd) or returned wrong values (dgrad), so a block-scaled fwd or dgrad whose
contraction is not a multiple of 512 stays on the grouped kernels.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["LOOP_MIN_FLOP_PER_EXPERT", "LOOP_MIN_FLOP_PER_EXPERT_BLOCK", "loop_why_not", "loop_wins"]

LOOP_MIN_FLOP_PER_EXPERT = 50e9
LOOP_MIN_FLOP_PER_EXPERT_BLOCK = 100e9


def loop_why_not(*, device: torch.device, group_sizes: Optional[Sequence[int]], out_dtype: torch.dtype,
                 block_scales: bool, formats: Sequence[str], epilogue: bool, wgrad: bool,
                 contraction: int) -> Optional[str]:
    """None if cuBLAS per expert can run the call (the grouped kernels' own conditions hold), else why not."""
    if group_sizes is None:
        return "the per-expert loop needs the group sizes on the host (group_sizes=)"
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "the per-expert loop's launches follow host sizes, so it is not captured in a CUDA graph"
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no torch._scaled_mm"
    if out_dtype != torch.bfloat16:
        return f"the per-expert loop writes bfloat16, received out_dtype={out_dtype}"
    if epilogue:
        return "a bias or row scale is fused by the grouped kernels only"
    if block_scales and any(f != "e4m3" for f in formats):
        return f"cuBLAS block scaling takes e4m3 operands, received {tuple(formats)}"
    if block_scales and not wgrad and contraction % 512:
        return f"cuBLAS 128x128 weight scales need a contraction that is a multiple of 512, received {contraction}"
    if wgrad and (sum(group_sizes) % 16 or any(rows % 16 for rows in group_sizes)):
        return "the per-expert wgrad reads each expert's tokens at 16-byte boundaries: rows multiples of 16"
    return None


def loop_wins(num_rows: int, k: int, n: int, num_groups: int, block_scales: bool) -> bool:
    """Each expert's GEMM long enough, on average, that cuBLAS per expert beats one grouped launch."""
    per_expert = LOOP_MIN_FLOP_PER_EXPERT_BLOCK if block_scales else LOOP_MIN_FLOP_PER_EXPERT
    return num_groups > 0 and 2.0 * num_rows * k * n >= per_expert * num_groups
