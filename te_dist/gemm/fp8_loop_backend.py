"""FP8 grouped GEMMs as one cuBLAS GEMM per expert (``torch._scaled_mm``), for few large experts.

Where every expert's GEMM is large, cuBLAS's dense FP8 kernels beat one grouped launch (decide.fp8_loop_wins says
when). Each expert is its own launch, so the host holds the group sizes (the MoE layer has them); no host sync, no
offsets read. Operands are the copies the grouped kernels read (:mod:`.fp8_operands`), sliced per expert:
  * per-tensor (DelayedScaling, Float8CurrentScaling): each operand's one scale; e5m2 gradients;
  * block (Float8BlockScaling): the 1x128 activation scales, made M-major per expert (cuBLAS's
    layout; one small copy each) by the weight's 128x128 scales; in wgrad 1x128 by 1x128 along the
    expert's tokens (the columnwise copies' scale rows, as they are).
cuBLAS promotes the FP8 products into fp32 (``use_fast_accum=False``).
"""

from __future__ import annotations

import torch

from .fp8_operands import columnwise_operand, one_scale, rowwise_operand, tensor_scales
from .loop_backend import expert_rows

__all__ = ["forward", "dgrad", "wgrad"]


def _row_gemms(aq, wq, b_data, b_scales, out_cols, out_dtype, group_sizes):
    """out[rows of e] = a[rows of e] @ b_data[e]^T (``b_data`` a copy of the prepared weight ``wq``); per-tensor
    scales where ``aq`` and ``wq`` have them, else 1x128 scales of a (made M-major, as cuBLAS reads 1x128 ones: the
    same shape, strides (1, rows)) by the 128x128 tables ``b_scales[e]`` laid [out/128, contraction/128]."""
    per_tensor = tensor_scales(aq, wq)
    a, a_scale = rowwise_operand(aq, scale_tables=not per_tensor)
    b_one_scale = one_scale(wq) if per_tensor else None
    out = torch.empty(a.shape[0], out_cols, device=a.device, dtype=out_dtype)
    for e, (s, t) in enumerate(expert_rows(None, group_sizes)):
        if t > s:
            sa, sb = a_scale, b_one_scale
            if b_one_scale is None:
                sa, sb = a_scale[s:t].t().contiguous().t(), b_scales[e].t()
            torch._scaled_mm(a[s:t], b_data[e].t(), sa, sb, out_dtype=out_dtype, out=out[s:t])
    return out


def forward(xq, wq, offsets_E, bias_EN=None, row_scale_T=None, out_dtype=torch.bfloat16, group_sizes=None):
    """y[rows of e] = x[rows of e] @ w[e]^T (the selector routes calls with an epilogue elsewhere)."""
    # w rowwise [E, N, K]; its scales [E, N/128, K/128] are the ones prepare_weight files as dgrad_scale
    return _row_gemms(xq, wq, wq.fwd_data, wq.dgrad_scale, wq.shape[1], out_dtype, group_sizes)


def dgrad(dyq, wq, offsets_E, out_dtype=torch.bfloat16, group_sizes=None):
    """dx[rows of e] = dy[rows of e] @ w[e]."""
    # w columnwise [E, K, N]; its scales [E, K/128, N/128] are the ones prepare_weight files as fwd_scale
    return _row_gemms(dyq, wq, wq.dgrad_data, wq.fwd_scale, wq.shape[2], out_dtype, group_sizes)


def wgrad(xq, dyq, offsets_E, num_groups: int, out_dtype=torch.bfloat16, group_sizes=None):
    """dw[e] = dy_e^T @ x_e as [E, N, K] from the columnwise copies (zeros for experts without rows)."""
    (T, K), N = xq.shape, dyq.shape[1]
    per_tensor = tensor_scales(xq, dyq)
    dyT, dyT_scale = columnwise_operand(dyq, scale_tables=not per_tensor)  # [N, T]
    xT, xT_scale = columnwise_operand(xq, scale_tables=not per_tensor)  # [K, T]
    dw = torch.empty(num_groups, N, K, device=dyT.device, dtype=out_dtype)
    for e, (s, t) in enumerate(expert_rows(None, group_sizes)):
        if t == s:
            dw[e].zero_()
            continue
        if per_tensor:
            sa, sb = dyT_scale, xT_scale
        else:  # scale rows [T/128 + 1, C]: the expert's blocks, M-major for A and row-major for B as they lie
            sa, sb = dyT_scale[s // 128:t // 128].t(), xT_scale[s // 128:t // 128]
        torch._scaled_mm(dyT[:, s:t], xT[:, s:t].t(), sa, sb, out_dtype=out_dtype, out=dw[e])
    return dw
