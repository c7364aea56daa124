"""The cross-entropy's backward that writes the logits' gradient as the LM head's FP8 operand.

One pass over the bf16 logits: each element's gradient ``(softmax - onehot) * g / T`` in float32, rounded to the
logits' dtype (what the bf16 path stores), then cast and written in both GEMM layouts, rows (dgrad's operand) and
the transposed copy (wgrad's), so every byte equals the bf16 gradient's cast by the recipe's per-tensor quantizer
(:func:`cross_entropy_grad_fp8`): the amax comes from the forward (``cross_entropy.forward_rows(dmax_bits=...)``: max
|softmax - onehot|), times |g / T| and rounded the same way.

Imported on the first such backward (it imports Triton); the CPU tests run it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..quantization.triton_fp8_math import _fp8_byte, _fp8_scale, _recip, _saturate
from ..quantization.triton_launch import cdiv, launch

__all__ = ["cross_entropy_grad_fp8"]

_ROW_WORDS, _NG, _G, _WARPS = 16, 1, 128, 4  # a program: 4 x 16 rows (16 words of the transposed copy) x 128 logits


@triton.jit
def _grad_fp8_kernel(logits, row_stride, targets, lse, grad_loss, dmax_bits, data, data_t, scale_inv, T, V,
                     inv_rows, FMT_MAX: tl.constexpr, POWER_2: tl.constexpr, A: tl.constexpr, NG: tl.constexpr,
                     G: tl.constexpr):
    """Rows 4a + j (a < A, j < 4) of the program's 4A, columns of its NG x G: each row set's FP8 bytes go out as
    rows, and the four sets' bytes of a column are packed into one uint32 (rows 4a..4a+3) and transposed as
    words ([A, NG, G] -> [NG, G, A]), as triton_casts._cast_tile_kernel does for its columnwise copy (single bytes
    transposed through shared memory conflict on banks)."""
    row0 = tl.program_id(0).to(tl.int64) * (4 * A)
    g = tl.program_id(1) * NG + tl.arange(0, NG)
    k = tl.arange(0, G)
    c3 = g[None, :, None] * G + k[None, None, :]  # [1, NG, G]
    c2 = g[:, None] * G + k[None, :]  # [NG, G]
    col_ok = c3 < V
    scale = tl.load(grad_loss).to(tl.float32) * inv_rows
    dtype = logits.dtype.element_ty
    FP8: tl.constexpr = data.dtype.element_ty
    amax = (tl.load(dmax_bits).to(tl.float32, bitcast=True) * tl.abs(scale)).to(dtype).to(tl.float32)
    mult = _fp8_scale(amax.to(tl.int32, bitcast=True), FMT_MAX, POWER_2)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_inv, _recip(mult))
    # the multiplier as a full [NG, G] tensor: with a scalar broadcast into the packed-word cast Triton 3.6 writes
    # wrong bytes on the GPU (triton_casts._cast_tile_kernel's note; the rows came out right, the words not)
    col_mult = (tl.zeros((NG, G), dtype=tl.float32) + mult)[None, :, :]
    a4 = row0 + 4 * tl.arange(0, A)
    words = tl.zeros((A, NG, G), dtype=tl.uint32)
    for j in tl.static_range(4):
        r = a4 + j
        ok = (r < T)[:, None, None] & col_ok
        x = tl.load(logits + r[:, None, None] * row_stride + c3, mask=ok, other=0.0).to(tl.float32)
        row_lse = tl.load(lse + r, mask=r < T, other=0.0)[:, None, None]
        target = tl.load(targets + r, mask=r < T, other=-1)[:, None, None]
        grad = ((tl.exp(x - row_lse) - tl.where(c3 == target, 1.0, 0.0)) * scale).to(dtype).to(tl.float32)
        tl.store(data + r[:, None, None] * V + c3, _saturate(grad * mult, FMT_MAX).to(FP8), mask=ok)
        words = words | (_fp8_byte(grad, col_mult, FMT_MAX, FP8) << (8 * j))
    wt = tl.permute(words, (1, 2, 0))  # [NG, G (column), A (row word)]
    w = (row0 // 4) + tl.arange(0, A)
    cols_w = data_t.to(tl.pointer_type(tl.uint32), bitcast=True)
    tl.store(cols_w + c2[:, :, None] * (T // 4) + w[None, None, :], wt,
             mask=(c2 < V)[:, :, None] & (w < T // 4)[None, None, :])


def cross_entropy_grad_fp8(logits_TV: torch.Tensor, targets_T: torch.Tensor, lse_T: torch.Tensor,
                           grad_loss: torch.Tensor, dmax_bits: torch.Tensor, fp8_dtype: torch.dtype, fmt_max: float,
                           power_2: bool):
    """``(data [T, V], data_t [V, T], scale_inv)``: the gradient of ``mean(cross_entropy(logits, targets))`` times
    ``grad_loss`` cast per tensor (``power_2``: the scale rounded down to a power of two). ``lse_T`` and
    ``dmax_bits`` from ``forward_rows(logits, targets, dmax_bits)``. T % 4 == 0 (the transposed copy is written
    in 4-row words); logits with unit column stride."""
    T, V = logits_TV.shape
    if T % 4 or logits_TV.stride(1) != 1:
        raise ValueError(f"the FP8 logits gradient needs rows in multiples of 4 and unit column stride, got shape "
                         f"{tuple(logits_TV.shape)} with strides {logits_TV.stride()}")
    device = logits_TV.device
    data = torch.empty((T, V), dtype=fp8_dtype, device=device)
    data_t = torch.empty((V, T), dtype=fp8_dtype, device=device)
    scale_inv = torch.empty((), dtype=torch.float32, device=device)
    grid = (cdiv(T, 4 * _ROW_WORDS), cdiv(V, _NG * _G))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        launch(_grad_fp8_kernel, grid, logits_TV, logits_TV.stride(0), targets_T, lse_T,
               grad_loss.reshape(1).to(torch.float32), dmax_bits, data, data_t, scale_inv, T, V, 1.0 / T,
               FMT_MAX=fmt_max, POWER_2=power_2, A=_ROW_WORDS, NG=_NG, G=_G, num_warps=_WARPS)
    return data, data_t, scale_inv

