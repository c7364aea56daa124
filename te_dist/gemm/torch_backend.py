"""``torch._grouped_mm`` backend: torch's own kernel, the default wherever it can run (see decide.py).

Operands reach torch as given: a weight passed as the transposed view of a contiguous [E, N, K] parameter is that
view, not a copy (torch reads either major order). Only a layout torch rejects (a sliced view off 16-byte rows, an
expanded gradient's zero strides) is copied, after torch said no: torch checks layouts in C++ before it launches
anything, so asking it first costs the usual call nothing. Each direction calls torch itself (a Python call on the
way is host time per GEMM). Its output dtype is the input's, so a row scale, bias or other output dtype runs as
separate torch ops afterwards.
"""

from __future__ import annotations

import torch

from .epilogue import apply_epilogue

__all__ = ["forward", "dgrad", "wgrad"]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when torch._grouped_mm accepts its layout (a 16-byte aligned base and, of the last
    two dims, one of unit stride and the other a multiple of 16 bytes), else a dense copy: row-major,
    or column-major where only the columns span whole 16 bytes (a transposed view keeps its order)."""
    step = 16 // t.element_size()
    row, col = t.stride()[-2:]
    if t.data_ptr() % 16 == 0 and ((col == 1 and row % step == 0 and row >= t.shape[-1])
                                   or (row == 1 and col % step == 0 and col >= t.shape[-2])):
        return t
    if t.shape[-1] % step and not t.shape[-2] % step:
        return t.transpose(-2, -1).clone(memory_format=torch.contiguous_format).transpose(-2, -1)
    return t.clone(memory_format=torch.contiguous_format)


def _again(a, b, offsets_E, error: RuntimeError) -> torch.Tensor:
    """torch's call again on copies of the layouts it refused (``error``, torch's own, where no copy mends one)."""
    a_copy, b_copy = _aligned(a), _aligned(b)
    if a_copy is a and b_copy is b:
        raise error
    return torch._grouped_mm(a_copy, b_copy, offs=offsets_E)


def forward(x_TK, w_EKN, offsets_E, bias_EN=None, row_scale_T=None, out_dtype=None, group_sizes=None) -> torch.Tensor:
    """torch._grouped_mm of the operands as given, then the epilogue asked for, if any."""
    try:
        acc_TN = torch._grouped_mm(x_TK, w_EKN, offs=offsets_E)
    except RuntimeError as error:
        acc_TN = _again(x_TK, w_EKN, offsets_E, error)
    if bias_EN is None is row_scale_T and (out_dtype is None or acc_TN.dtype == out_dtype):  # nothing to apply
        return acc_TN
    return apply_epilogue(acc_TN, offsets_E, bias_EN, row_scale_T, out_dtype or x_TK.dtype)


def dgrad(dy_TN, w_EKN, offsets_E, row_scale_T=None, out_dtype=None, group_sizes=None) -> torch.Tensor:
    try:  # .mT: 2/3 of transpose(1, 2)'s time
        acc_TK = torch._grouped_mm(dy_TN, w_EKN.mT, offs=offsets_E)
    except RuntimeError as error:
        acc_TK = _again(dy_TN, w_EKN.mT, offsets_E, error)
    if row_scale_T is None and (out_dtype is None or acc_TK.dtype == out_dtype):
        return acc_TK
    return apply_epilogue(acc_TK, offsets_E, None, row_scale_T, out_dtype or dy_TN.dtype)


def wgrad(x_TK, dy_TN, offsets_E, num_groups: int, out_dtype=None, group_sizes=None) -> torch.Tensor:
    """dw[e] = (dy_e^T @ x_e) as [E, N, K]; returned transposed as [E, K, N]."""
    try:
        dw_ENK = torch._grouped_mm(dy_TN.mT, x_TK, offs=offsets_E)
    except RuntimeError as error:
        dw_ENK = _again(dy_TN.mT, x_TK, offsets_E, error)
    return (dw_ENK if out_dtype is None or dw_ENK.dtype == out_dtype else dw_ENK.to(out_dtype)).mT
