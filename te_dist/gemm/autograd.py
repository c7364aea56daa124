"""Autograd for y = row_scale[:, None] * (x @ w[e]) + bias[e] over expert row groups.

Backward, per expert e with s = row_scale and g = dy @ w[e]^T (the unscaled dgrad)::

    dx      = s * g                      (dgrad; s fused into the epilogue when s needs no grad)
    dw[e]   = x_e^T @ (s * dy)_e         (wgrad, written in the weight's [E, N, K] layout)
    dbias[e]= sum of dy over rows of e
    ds[t]   = <dy[t], x[t] @ w[e]> = <g[t], x[t]>   (no need to save the GEMM output)
"""

from __future__ import annotations

import torch

from .epilogue import bias_grad

__all__ = ["GroupedMM"]


class GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, backend, dispatch, group_sizes=None):
        y_TN = dispatch("fwd", (x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype), backend, group_sizes)
        ctx.save_for_backward(x_TK, w_EKN, offsets_E, row_scale_T)
        ctx.bias_dtype = None if bias_EN is None else bias_EN.dtype
        ctx.run = (dispatch, backend, group_sizes)  # how backward runs its GEMMs
        return y_TN

    @staticmethod
    def backward(ctx, dy_TN):
        x_TK, w_EKN, offsets_E, row_scale_T = ctx.saved_tensors
        dispatch, backend, sizes = ctx.run
        need_dx, need_dw, _, need_db, need_ds = ctx.needs_input_grad[:5]
        num_groups = w_EKN.shape[0]
        dy_TN = dy_TN.contiguous()
        dy_mm = dy_TN if dy_TN.dtype == x_TK.dtype else dy_TN.to(x_TK.dtype)
        dx = dw = db = ds = None
        if need_ds and row_scale_T is not None:
            g_TK = dispatch("dgrad", (dy_mm, w_EKN, offsets_E, None, torch.float32), backend, sizes)
            ds = (g_TK.float() * x_TK.float()).sum(dim=1).to(row_scale_T.dtype)
            if need_dx:
                dx = (g_TK.float() * row_scale_T.float()[:, None]).to(x_TK.dtype)
        elif need_dx:
            dx = dispatch("dgrad", (dy_mm, w_EKN, offsets_E, row_scale_T, x_TK.dtype), backend, sizes)
        if need_dw:
            dy_w = dy_mm if row_scale_T is None else (dy_TN.float() * row_scale_T.float()[:, None]).to(x_TK.dtype)
            dw = dispatch("wgrad", (x_TK, dy_w, offsets_E, num_groups, w_EKN.dtype), backend, sizes)
        if need_db and ctx.bias_dtype is not None:
            db = bias_grad(dy_TN, offsets_E, num_groups, ctx.bias_dtype)
        return dx, dw, None, db, ds, None, None, None, None
