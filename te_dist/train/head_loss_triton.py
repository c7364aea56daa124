"""The cross-entropy's backward that writes the logits' gradient as the LM head's FP8 operand.

One pass over the bf16 logits: each element's gradient ``(softmax - onehot) * g / T`` in float32, rounded to the
logits' dtype (what the bf16 path stores), then cast and written in both GEMM layouts, rows (dgrad's operand) and
the transposed copy (wgrad's), so every byte equals the bf16 gradient's cast by the recipe's quantizer:

* per tensor (:func:`cross_entropy_grad_fp8`): the amax comes from the forward (``cross_entropy.forward_rows(
  dmax_bits=...)``: max |softmax - onehot|), times |g / T| and rounded the same way;
* 1x128 blocks (:func:`cross_entropy_grad_fp8_blocks`, Float8BlockScaling's gradient): a program owns 128 rows,
  the amaxes are its own (rows per 128 columns, columns per 128 rows), as ``triton_casts._cast_tile_kernel``
  casts a bf16 tensor, so no forward amax is needed.

Imported on the first such backward (it imports Triton); the CPU tests run it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..quantization.triton_casts import _store_rowwise
from ..quantization.triton_fp8_math import _abs_bits4, _block_scale, _fp8_byte, _fp8_scale, _recip, _saturate
from ..quantization.triton_launch import cdiv, launch

__all__ = ["cross_entropy_grad_fp8", "cross_entropy_grad_fp8_blocks"]

_ROW_WORDS, _NG, _G, _WARPS = 16, 1, 128, 4  # a program: 4 x 16 rows (16 words of the transposed copy) x 128 logits
_BLOCKS_NG, _BLOCKS_WARPS = 1, 8  # the 1x128 kernel: a program is 128 rows (one column block) x 128 logits


@triton.jit
def _grad_rows(logits, row_stride, targets, lse, r, c3, ok, scale):
    """The gradient of rows r ([A]) at columns c3 ([1, NG, G]) as the bf16 path stores it, float32 [A, NG, G]
    (zero where not ``ok``)."""
    x = tl.load(logits + r[:, None, None] * row_stride + c3, mask=ok, other=0.0).to(tl.float32)
    row_lse = tl.load(lse + r)[:, None, None]
    target = tl.load(targets + r)[:, None, None]
    grad = ((tl.exp(x - row_lse) - tl.where(c3 == target, 1.0, 0.0)) * scale).to(logits.dtype.element_ty)
    return tl.where(ok, grad.to(tl.float32), 0.0)


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


@triton.jit
def _grad_fp8_blocks_kernel(logits, row_stride, targets, lse, grad_loss, row_data, row_s, col_data, col_s, T, V,
                            inv_rows, FMT_MAX: tl.constexpr, POWER_2: tl.constexpr, NG: tl.constexpr,
                            G: tl.constexpr):
    """Rows row0 .. row0 + G of the gradient, columns of the program's NG x G: the 1x128 casts of
    ``triton_casts._cast_tile_kernel`` (ROW, COL, COL_T, one sub-tile of G rows) on the gradient computed in place
    of a load, read as four row sets (rows 4a + j); the transposed copy's bytes of rows 4a..4a+3 packed into one
    uint32 and stored as words, the column scales M-major [T/G + 1, V] with a zero last row."""
    row0 = tl.program_id(0).to(tl.int64) * G
    A: tl.constexpr = G // 4
    r = row0 + 4 * tl.arange(0, A)
    g = tl.program_id(1) * NG + tl.arange(0, NG)
    k = tl.arange(0, G)
    num_g = V // G
    c3 = g[None, :, None] * G + k[None, None, :]  # [1, NG, G]
    c2 = g[:, None] * G + k[None, :]  # [NG, G]
    ok = g[None, :, None] < num_g
    scale = tl.load(grad_loss).to(tl.float32) * inv_rows
    FP8: tl.constexpr = col_data.dtype.element_ty
    x0 = _grad_rows(logits, row_stride, targets, lse, r, c3, ok, scale)
    x1 = _grad_rows(logits, row_stride, targets, lse, r + 1, c3, ok, scale)
    x2 = _grad_rows(logits, row_stride, targets, lse, r + 2, c3, ok, scale)
    x3 = _grad_rows(logits, row_stride, targets, lse, r + 3, c3, ok, scale)
    sq = tl.full((NG,), 1.0, dtype=tl.float32)  # no square scale (1x128 blocks)
    _store_rowwise(x0, r, row_data, row_s, V, c3, g, num_g, ok, sq, FMT_MAX, POWER_2, False, 0, 0, False)
    _store_rowwise(x1, r + 1, row_data, row_s, V, c3, g, num_g, ok, sq, FMT_MAX, POWER_2, False, 0, 0, False)
    _store_rowwise(x2, r + 2, row_data, row_s, V, c3, g, num_g, ok, sq, FMT_MAX, POWER_2, False, 0, 0, False)
    _store_rowwise(x3, r + 3, row_data, row_s, V, c3, g, num_g, ok, sq, FMT_MAX, POWER_2, False, 0, 0, False)
    col_mult, col_stored = _block_scale(tl.max(_abs_bits4(x0, x1, x2, x3), axis=0), FMT_MAX, POWER_2, False, 0, 0)
    g_ok = g[:, None] < num_g
    tl.store(col_s + (row0 // G) * V + c2, col_stored, mask=g_ok)
    if row0 + G == T:  # the last block row's programs also write the zero row after it
        tl.store(col_s + (T // G) * V + c2, tl.zeros((NG, G), dtype=tl.float32), mask=g_ok)
    mult = col_mult[None, :, :]
    w = (_fp8_byte(x0, mult, FMT_MAX, FP8) | (_fp8_byte(x1, mult, FMT_MAX, FP8) << 8)
         | (_fp8_byte(x2, mult, FMT_MAX, FP8) << 16) | (_fp8_byte(x3, mult, FMT_MAX, FP8) << 24))
    wt = tl.permute(w, (1, 2, 0))  # [NG, G (column), A (row word)]
    words = c2[:, :, None] * (T // 4) + (row0 // 4 + tl.arange(0, A))[None, None, :]
    tl.store(col_data.to(tl.pointer_type(tl.uint32), bitcast=True) + words, wt, mask=g_ok[:, :, None])


def cross_entropy_grad_fp8_blocks(logits_TV: torch.Tensor, targets_T: torch.Tensor, lse_T: torch.Tensor,
                                  grad_loss: torch.Tensor, fp8_dtype: torch.dtype, fmt_max: float, power_2: bool):
    """``(data [T, V], scale_inv [T, V/128], data_t [V, T], scale_inv_t [T/128 + 1, V])``: the gradient of
    ``mean(cross_entropy(logits, targets))`` times ``grad_loss`` in 1x128 blocks, rows and transposed copy, the
    latter's scales M-major with a zero last row (what ``Float8BlockQuantizer`` makes of a 2-D gradient for the
    wgrad kernel); ``power_2``: scales rounded down to powers of two. ``lse_T`` from ``forward_rows``. T and V
    multiples of 128; logits with unit column stride."""
    T, V = logits_TV.shape
    if T % _G or V % _G or logits_TV.stride(1) != 1:
        raise ValueError(f"the 1x128-block FP8 logits gradient needs rows and columns in multiples of {_G} and unit "
                         f"column stride, got shape {tuple(logits_TV.shape)} with strides {logits_TV.stride()}")
    device = logits_TV.device
    data = torch.empty((T, V), dtype=fp8_dtype, device=device)
    scale_inv = torch.empty((T, V // _G), dtype=torch.float32, device=device)
    data_t = torch.empty((V, T), dtype=fp8_dtype, device=device)
    scale_inv_t = torch.empty((T // _G + 1, V), dtype=torch.float32, device=device)
    grid = (T // _G, cdiv(V // _G, _BLOCKS_NG))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        launch(_grad_fp8_blocks_kernel, grid, logits_TV, logits_TV.stride(0), targets_T, lse_T,
               grad_loss.reshape(1).to(torch.float32), data, scale_inv, data_t, scale_inv_t, T, V, 1.0 / T,
               FMT_MAX=fmt_max, POWER_2=power_2, NG=_BLOCKS_NG, G=_G, num_warps=_BLOCKS_WARPS)
    return data, scale_inv, data_t, scale_inv_t
