"""Per-expert loop backend, and the float32 reference for every other backend.

Why keep it: it runs everywhere (CPU, old torch, fp16/fp32, any strides) and, on tiny decode
shapes, a few plain GEMMs can beat one grouped launch. It reads offsets on the host, so on CUDA
it syncs and cannot be captured in a CUDA graph (the selector never picks it while capturing).

On CPU it computes in float32 (exact reference semantics); on CUDA it runs ``torch.mm`` in the
input dtype (fp32 accumulate inside cuBLAS) and applies the epilogue in float32.
"""

from __future__ import annotations

import torch

from .epilogue import apply_epilogue

__all__ = ["forward", "dgrad", "wgrad"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.device.type == "cpu" else t.dtype


def _bounds(offsets_E: torch.Tensor):
    """(start, end) rows of each expert, read on the host (the loop's one sync)."""
    ends = offsets_E.tolist()
    return list(zip([0] + ends[:-1], ends))


def _mm_rows(a_TX, b_EXY, bounds, cdt) -> torch.Tensor:
    """acc[rows of e] = a[rows of e] @ b[e] in ``cdt``, written straight into one buffer (no
    per-expert temporaries; slicing measured faster than ``split`` for a handful of experts)."""
    acc = torch.empty(a_TX.shape[0], b_EXY.shape[2], device=a_TX.device, dtype=cdt)
    a = a_TX if a_TX.dtype == cdt else a_TX.to(cdt)
    b = b_EXY if b_EXY.dtype == cdt else b_EXY.to(cdt)
    for e, (s, t) in enumerate(bounds):
        if t > s:
            torch.mm(a[s:t], b[e], out=acc[s:t])
    return acc


def forward(x_TK, w_EKN, offsets_E, bias_EN=None, row_scale_T=None, out_dtype=None) -> torch.Tensor:
    out_dtype = out_dtype or x_TK.dtype
    if x_TK.shape[0] == 0:
        return torch.empty(0, w_EKN.shape[2], device=x_TK.device, dtype=out_dtype)
    acc_TN = _mm_rows(x_TK, w_EKN, _bounds(offsets_E), _compute_dtype(x_TK))
    return apply_epilogue(acc_TN, offsets_E, bias_EN, row_scale_T, out_dtype)


def dgrad(dy_TN, w_EKN, offsets_E, row_scale_T=None, out_dtype=None) -> torch.Tensor:
    """dx[rows of e] = row_scale * (dy @ w[e]^T)."""
    out_dtype = out_dtype or dy_TN.dtype
    if dy_TN.shape[0] == 0:
        return torch.empty(0, w_EKN.shape[1], device=dy_TN.device, dtype=out_dtype)
    acc_TK = _mm_rows(dy_TN, w_EKN.transpose(1, 2), _bounds(offsets_E), _compute_dtype(dy_TN))
    return apply_epilogue(acc_TK, offsets_E, None, row_scale_T, out_dtype)


def wgrad(x_TK, dy_TN, offsets_E, num_groups: int, out_dtype=None) -> torch.Tensor:
    """dw[e] = x_e^T @ dy_e, returned as [E, K, N] viewing a contiguous [E, N, K] buffer (weight layout)."""
    out_dtype = out_dtype or x_TK.dtype
    K, N = x_TK.shape[1], dy_TN.shape[1]
    cdt = _compute_dtype(x_TK)
    dw_ENK = torch.zeros(num_groups, N, K, device=x_TK.device, dtype=out_dtype)
    x, dy = x_TK.to(cdt), dy_TN.to(cdt)
    direct = out_dtype == cdt
    for e, (s, t) in enumerate(_bounds(offsets_E)):
        if t == s:
            continue
        if direct:
            torch.mm(dy[s:t].t(), x[s:t], out=dw_ENK[e])
        else:
            dw_ENK[e] = torch.mm(dy[s:t].t(), x[s:t]).to(out_dtype)
    return dw_ENK.transpose(1, 2)
