"""``torch._grouped_mm`` backend: torch's own kernel, the default wherever it can run (see decide.py).

Operands reach torch as given: a weight passed as the transposed view of a contiguous [E, N, K]
parameter is that view, not a copy (torch reads either major order). Only a layout torch rejects
(a sliced view off 16-byte rows, an expanded gradient's zero strides) is copied. Its output dtype
is the input's, so a row scale, bias or other output dtype runs as separate torch ops afterwards.
"""

from __future__ import annotations

import torch

from .epilogue import apply_epilogue

__all__ = ["is_available", "forward", "dgrad", "wgrad"]


def is_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when torch._grouped_mm accepts its layout, else a contiguous copy: a 16-byte
    aligned base and, of the last two dims, one of unit stride and the other a multiple of 16 bytes."""
    step = 16 // t.element_size()
    row, col = t.stride()[-2:]
    if t.data_ptr() % 16 == 0 and ((col == 1 and row % step == 0 and row >= t.shape[-1])
                                   or (row == 1 and col % step == 0 and col >= t.shape[-2])):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def forward(x_TK, w_EKN, offsets_E, bias_EN=None, row_scale_T=None, out_dtype=None) -> torch.Tensor:
    acc_TN = torch._grouped_mm(_aligned(x_TK), _aligned(w_EKN), offs=offsets_E)
    return apply_epilogue(acc_TN, offsets_E, bias_EN, row_scale_T, out_dtype or x_TK.dtype)


def dgrad(dy_TN, w_EKN, offsets_E, row_scale_T=None, out_dtype=None) -> torch.Tensor:
    acc_TK = torch._grouped_mm(_aligned(dy_TN), _aligned(w_EKN).transpose(1, 2), offs=offsets_E)
    return apply_epilogue(acc_TK, offsets_E, None, row_scale_T, out_dtype or dy_TN.dtype)


def wgrad(x_TK, dy_TN, offsets_E, num_groups: int, out_dtype=None) -> torch.Tensor:
    """dw[e] = (dy_e^T @ x_e) as [E, N, K]; returned transposed as [E, K, N]."""
    out_dtype = out_dtype or x_TK.dtype
    dw_ENK = torch._grouped_mm(_aligned(dy_TN).t(), _aligned(x_TK), offs=offsets_E)
    return (dw_ENK if dw_ENK.dtype == out_dtype else dw_ENK.to(out_dtype)).transpose(1, 2)
