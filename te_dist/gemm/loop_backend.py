"""Per-expert loop backend, and the float32 reference for every other backend.

It runs everywhere (CPU, old torch, fp16/fp32, any strides), and cuBLAS per expert can beat one
grouped launch for a few large experts. Without host group sizes it reads the offsets on the host,
so on CUDA it syncs and is never picked while capturing a CUDA graph. On CPU it computes in float32;
on CUDA it runs ``torch.mm`` in the input dtype and the epilogue in float32.

On CPU the loop runs in C++ where the shapes allow: ``torch._grouped_mm``'s CPU kernel is the same loop
(``at::mm_out`` per expert into one output, zeros for experts without rows), without a Python round trip per expert.
It needs rows of whole 16 bytes (K and N multiples of 4 float32s; a layout torch refuses is copied, by the torch
backend's one statement of that rule); other shapes, and torches without a CPU ``_grouped_mm``, take the Python loop.
"""

from __future__ import annotations

import functools
import itertools

import torch

from . import torch_backend
from .epilogue import apply_epilogue

__all__ = ["expert_rows", "forward", "dgrad", "wgrad"]


def expert_rows(offsets_E: torch.Tensor, group_sizes=None):
    """(start, end) rows of each expert: from ``group_sizes`` (host ints, or a CPU tensor of them)
    when the caller has them, else read from the offsets on the host (the loop's one sync)."""
    if isinstance(group_sizes, torch.Tensor):
        group_sizes = group_sizes.tolist()
    ends = offsets_E.tolist() if group_sizes is None else list(itertools.accumulate(group_sizes))
    return list(zip([0] + ends[:-1], ends))


@functools.lru_cache(maxsize=None)
def _cpu_grouped_mm_available() -> bool:
    """Whether this torch runs ``torch._grouped_mm`` on CPU float32 as the per-expert mm loop (probed once)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.arange(32, dtype=torch.float32).reshape(2, 4, 4)
    offs = torch.tensor([1, 3], dtype=torch.int32)
    try:
        got = torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    want = torch.cat((a[:1] @ b[0], a[1:] @ b[1]))
    return tuple(got.shape) == (3, 4) and bool(torch.equal(got, want))


def _use_native(a: torch.Tensor, out_cols: int) -> bool:
    """CPU float32 operands (the loop's compute dtype there) whose contraction rows and output rows
    are whole 16 bytes, so that every operand torch refuses as laid out takes a dense copy."""
    return a.is_cpu and a.shape[-1] % 4 == 0 and out_cols % 4 == 0 and _cpu_grouped_mm_available()


def _mm_rows(a_TX, b_EXY, offsets_E, cdt, group_sizes=None) -> torch.Tensor:
    """acc[rows of e] = a[rows of e] @ b[e] in ``cdt``, written straight into one buffer (no
    per-expert temporaries): the C++ loop on CPU, else per-expert ``mm`` into slices (slicing
    measured faster than ``split`` for a handful of experts)."""
    a = a_TX if a_TX.dtype == cdt else a_TX.to(cdt)
    b = b_EXY if b_EXY.dtype == cdt else b_EXY.to(cdt)
    if _use_native(a, b.shape[2]):
        return torch_backend.forward(a, b, offsets_E)
    acc = torch.empty(a.shape[0], b.shape[2], device=a.device, dtype=cdt)
    for e, (s, t) in enumerate(expert_rows(offsets_E, group_sizes)):
        if t > s:
            torch.mm(a[s:t], b[e], out=acc[s:t])
    return acc


def forward(x_TK, w_EKN, offsets_E, bias_EN=None, row_scale_T=None, out_dtype=None, group_sizes=None) -> torch.Tensor:
    """``group_sizes`` (every entry point): the rows of each expert as host ints, so no offsets read."""
    out_dtype = out_dtype or x_TK.dtype
    if x_TK.shape[0] == 0:
        return torch.empty(0, w_EKN.shape[2], device=x_TK.device, dtype=out_dtype)
    acc_TN = _mm_rows(x_TK, w_EKN, offsets_E, torch.float32 if x_TK.is_cpu else x_TK.dtype, group_sizes)
    return apply_epilogue(acc_TN, offsets_E, bias_EN, row_scale_T, out_dtype)


def dgrad(dy_TN, w_EKN, offsets_E, row_scale_T=None, out_dtype=None, group_sizes=None) -> torch.Tensor:
    """dx[rows of e] = row_scale * (dy @ w[e]^T): the forward against the weight's [E, N, K] view."""
    return forward(dy_TN, w_EKN.transpose(1, 2), offsets_E, None, row_scale_T, out_dtype, group_sizes)


def wgrad(x_TK, dy_TN, offsets_E, num_groups: int, out_dtype=None, group_sizes=None) -> torch.Tensor:
    """dw[e] = x_e^T @ dy_e, returned as [E, K, N] viewing a contiguous [E, N, K] buffer (weight layout)."""
    out_dtype = out_dtype or x_TK.dtype
    K, N = x_TK.shape[1], dy_TN.shape[1]
    cdt = torch.float32 if x_TK.is_cpu else x_TK.dtype  # the compute dtype (module doc)
    x = x_TK if x_TK.dtype == cdt else x_TK.to(cdt)
    dy = dy_TN if dy_TN.dtype == cdt else dy_TN.to(cdt)
    if x.shape[0] and num_groups and N % 4 == 0 and _use_native(x, K):
        # dy^T per expert: the C++ loop writes [E, N, K] and zero-fills experts without rows.
        return torch_backend.wgrad(x, dy, offsets_E, num_groups, out_dtype)
    # Every expert's slice is written below (zeros for those without rows): no full zero pass first.
    dw_ENK = torch.empty(num_groups, N, K, device=x.device, dtype=out_dtype)
    direct = out_dtype == cdt
    for e, (s, t) in enumerate(expert_rows(offsets_E, group_sizes)):
        if t == s:
            dw_ENK[e].zero_()
            continue
        if direct:
            torch.mm(dy[s:t].t(), x[s:t], out=dw_ENK[e])
        else:
            dw_ENK[e] = torch.mm(dy[s:t].t(), x[s:t]).to(out_dtype)
    return dw_ENK.transpose(1, 2)
