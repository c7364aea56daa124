"""Per-expert loop backend, and the float32 reference for every other backend.

Why keep it: it runs everywhere (CPU, old torch, fp16/fp32, any strides) and, on tiny decode
shapes, a few plain GEMMs can beat one grouped launch. It reads offsets on the host, so on CUDA
it syncs and cannot be captured in a CUDA graph (the selector never picks it while capturing).

On CPU it computes in float32 (exact reference semantics); on CUDA it runs ``torch.mm`` in the
input dtype (fp32 accumulate inside cuBLAS) and applies the epilogue in float32.
"""

from __future__ import annotations

import torch

__all__ = ["forward", "dgrad", "wgrad"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.device.type == "cpu" else t.dtype


def _bounds(offsets_E: torch.Tensor):
    ends = offsets_E.tolist()
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def forward(x_TK, w_EKN, offsets_E, bias_EN=None, row_scale_T=None, out_dtype=None) -> torch.Tensor:
    out_dtype = out_dtype or x_TK.dtype
    T, N = x_TK.shape[0], w_EKN.shape[2]
    cdt = _compute_dtype(x_TK)
    y_TN = torch.empty(T, N, device=x_TK.device, dtype=out_dtype)
    if T == 0:
        return y_TN
    plain = x_TK.dtype == cdt == out_dtype and w_EKN.dtype == cdt and bias_EN is None and row_scale_T is None
    for e, (s, t) in enumerate(_bounds(offsets_E)):
        if t == s:
            continue
        if plain:  # no casts, no epilogue: write straight into the output rows (CPU overhead path)
            torch.mm(x_TK[s:t], w_EKN[e], out=y_TN[s:t])
            continue
        acc = torch.mm(x_TK[s:t].to(cdt), w_EKN[e].to(cdt)).float()
        if row_scale_T is not None:
            acc = acc * row_scale_T[s:t].float()[:, None]
        if bias_EN is not None:
            acc = acc + bias_EN[e].float()
        y_TN[s:t] = acc.to(out_dtype)
    return y_TN


def dgrad(dy_TN, w_EKN, offsets_E, row_scale_T=None, out_dtype=None) -> torch.Tensor:
    """dx[rows of e] = row_scale * (dy @ w[e]^T)."""
    out_dtype = out_dtype or dy_TN.dtype
    T, K = dy_TN.shape[0], w_EKN.shape[1]
    cdt = _compute_dtype(dy_TN)
    dx_TK = torch.empty(T, K, device=dy_TN.device, dtype=out_dtype)
    if T == 0:
        return dx_TK
    plain = dy_TN.dtype == cdt == out_dtype and w_EKN.dtype == cdt and row_scale_T is None
    for e, (s, t) in enumerate(_bounds(offsets_E)):
        if t == s:
            continue
        if plain:
            torch.mm(dy_TN[s:t], w_EKN[e].t(), out=dx_TK[s:t])
            continue
        acc = torch.mm(dy_TN[s:t].to(cdt), w_EKN[e].to(cdt).t()).float()
        if row_scale_T is not None:
            acc = acc * row_scale_T[s:t].float()[:, None]
        dx_TK[s:t] = acc.to(out_dtype)
    return dx_TK


def wgrad(x_TK, dy_TN, offsets_E, num_groups: int, out_dtype=None) -> torch.Tensor:
    """dw[e] = x_e^T @ dy_e, returned as [E, K, N] viewing a contiguous [E, N, K] buffer (weight layout)."""
    out_dtype = out_dtype or x_TK.dtype
    K, N = x_TK.shape[1], dy_TN.shape[1]
    cdt = _compute_dtype(x_TK)
    dw_ENK = torch.zeros(num_groups, N, K, device=x_TK.device, dtype=out_dtype)
    plain = x_TK.dtype == dy_TN.dtype == cdt == out_dtype
    for e, (s, t) in enumerate(_bounds(offsets_E)):
        if t == s:
            continue
        if plain:
            torch.mm(dy_TN[s:t].t(), x_TK[s:t], out=dw_ENK[e])
            continue
        dw_ENK[e] = torch.mm(dy_TN[s:t].to(cdt).t(), x_TK[s:t].to(cdt)).to(out_dtype)
    return dw_ENK.transpose(1, 2)
