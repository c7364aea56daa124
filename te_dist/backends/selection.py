"""Backend choice for one grouped-GEMM call, as a readable table (no launches, no env reads).

Order of preference (first row whose conditions hold wins):

| backend | when |
|---|---|
| forced  | ``backend=`` given: used if it can run, else ValueError saying why (``torch`` may be forced on CPU) |
| loop    | CPU tensors (the float32 reference path) |
| loop    | CUDA, the caller passed the group sizes (host ints, so no read), not capturing, fwd or dgrad, at most ``LOOP_MAX_GROUPS`` groups of ``LOOP_MIN_ROWS_PER_GROUP`` rows or more on average and a contraction of ``LOOP_MIN_CONTRACTION`` or more: cuBLAS per expert |
| cutlass | CUDA SM 9.0, bf16 in, bf16/fp32 out, K and N multiples of 8 (16-byte TMA rows), weight stored [E, N, K] (K-major), our kernels built |
| loop    | decode-sized problems (average rows per expert <= ``DECODE_ROWS_PER_EXPERT``) when not capturing a CUDA graph and no cutlass |
| torch   | CUDA SM >= 9.0, bf16, K and N multiples of 8, ``torch._grouped_mm`` present |
| loop    | everything else (fp16/fp32, old torch, odd strides); refused while capturing a CUDA graph |

The decode threshold comes from the H200 measurements in docs/kernels.md: on the two decode
shapes measured there the loop lost to torch._grouped_mm, so the row is off (0) until a shape
where it wins is measured; the knob stays so that finding needs a one-line change.

The cuBLAS row comes from ragged splits (router-like group sizes, as a real MoE step has them;
docs/kernels.md "Ragged group sizes"): a grouped kernel pads every group to its tile's rows and
runs whole waves of tiles, while cuBLAS sizes each expert's GEMM on its own. For a few large
experts with a long contraction (the Mixtral-like fc1 dgrad, K 28672, and fc2 forward, K 14336)
cuBLAS per expert beat every grouped kernel by 4-22% in all four Mixtral-like rows measured; with
many experts (32-64) or a short contraction it lost. It needs the sizes on the host, which the
MoE layer has from its count exchange; without them the loop would have to read the offsets.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

__all__ = [
    "BACKENDS",
    "DECODE_ROWS_PER_EXPERT",
    "LOOP_MAX_GROUPS",
    "LOOP_MIN_ROWS_PER_GROUP",
    "LOOP_MIN_CONTRACTION",
    "Problem",
    "choose_backend",
    "why_not",
]

BACKENDS = ("cutlass", "torch", "loop")
DECODE_ROWS_PER_EXPERT = 0  # H200 sweep: the loop never beat torch._grouped_mm (docs/kernels.md)
# cuBLAS per expert over the grouped kernels when the group sizes are known (module docstring).
LOOP_MAX_GROUPS = 8
LOOP_MIN_ROWS_PER_GROUP = 512
LOOP_MIN_CONTRACTION = 8192


class Problem(NamedTuple):
    """What the selector needs to know about one call (direction: "fwd" | "dgrad" | "wgrad").
    A NamedTuple: built on every call, and a frozen dataclass of 11 fields cost ~5x as much."""

    direction: str
    device_type: str
    capability: Optional[Tuple[int, int]]
    dtype: torch.dtype
    out_dtype: torch.dtype
    num_rows: int
    k: int  # fwd: in-features, dgrad: out-features (each the contraction); wgrad: in-features
    n: int
    num_groups: int
    weight_k_major: bool = True
    capturing: bool = False
    sizes_on_host: bool = False  # the caller passed the rows of each group as host ints


def why_not(backend: str, p: Problem, *, cutlass_built: bool, torch_grouped: bool) -> Optional[str]:
    """None if ``backend`` can run ``p``, else the reason it cannot (used in errors and docs)."""
    if backend == "loop":
        if p.capturing:
            return "the per-expert loop reads offsets on the host and cannot run inside CUDA graph capture"
        return None
    if backend == "torch" and p.device_type == "cpu":
        # torch's CPU grouped_mm (recent torch) is a plain loop: allowed when forced, never auto-picked.
        return None if torch_grouped else "this torch has no torch._grouped_mm"
    if p.device_type != "cuda":
        return f"{backend} needs CUDA tensors, received device type {p.device_type!r}"
    if p.dtype != torch.bfloat16:
        return f"{backend} supports bfloat16 inputs only, received {p.dtype}"
    if p.k % 8 or p.n % 8:
        return f"{backend} needs K and N to be multiples of 8 (16-byte rows), received K={p.k} N={p.n}"
    if backend == "torch":
        if not torch_grouped:
            return "this torch has no torch._grouped_mm"
        if p.capability is None or p.capability < (9, 0):
            return f"torch._grouped_mm bf16 needs compute capability >= 9.0, received {p.capability}"
        return None
    if backend == "cutlass":
        if p.capability != (9, 0):
            return f"cutlass_kernels are built for sm_90a only, received compute capability {p.capability}"
        if p.out_dtype not in (torch.bfloat16, torch.float32):
            return f"cutlass_kernels write bfloat16 or float32, received out_dtype={p.out_dtype}"
        if p.direction != "wgrad" and not p.weight_k_major:
            return "cutlass_kernels need w_EKN to be a transposed view of a contiguous [E, N, K] weight"
        if not cutlass_built:
            return "cutlass_kernels are not available (no nvcc / CUTLASS headers, disabled, or the build failed)"
        return None
    raise ValueError(f"backend must be one of {BACKENDS} or None, received {backend!r}")


def choose_backend(p: Problem, *, cutlass_built: bool, torch_grouped: bool, forced: Optional[str] = None) -> str:
    if forced is not None:
        reason = why_not(forced, p, cutlass_built=cutlass_built, torch_grouped=torch_grouped)
        if reason is not None:
            raise ValueError(f"backend={forced!r} cannot run this {p.direction} call: {reason}")
        return forced
    if p.device_type != "cuda":
        return "loop"
    if _cublas_per_expert_wins(p):
        return "loop"
    if why_not("cutlass", p, cutlass_built=cutlass_built, torch_grouped=torch_grouped) is None:
        return "cutlass"
    decode = p.num_groups > 0 and p.num_rows <= DECODE_ROWS_PER_EXPERT * p.num_groups
    if decode and not p.capturing:
        return "loop"
    if why_not("torch", p, cutlass_built=cutlass_built, torch_grouped=torch_grouped) is None:
        return "torch"
    reason = why_not("loop", p, cutlass_built=cutlass_built, torch_grouped=torch_grouped)
    if reason is not None:
        raise ValueError(f"no grouped-GEMM backend can run this {p.direction} call: {reason}")
    return "loop"


def _cublas_per_expert_wins(p: Problem) -> bool:
    """The table's cuBLAS row: few large groups, a long contraction, sizes known on the host."""
    return (
        p.sizes_on_host
        and not p.capturing
        and p.direction != "wgrad"
        and 0 < p.num_groups <= LOOP_MAX_GROUPS
        and p.num_rows >= LOOP_MIN_ROWS_PER_GROUP * p.num_groups
        and p.k >= LOOP_MIN_CONTRACTION
    )
