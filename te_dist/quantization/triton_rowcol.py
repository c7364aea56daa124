"""The per-tensor FP8 casts that also write the transposed copy (a grouped weight's dgrad layout),
for current scaling (amax from x or given) and delayed scaling, on stacks of matrices x [..., R, C].

Two paths, the same bytes: the one-pass CUDA cast (:mod:`.cuda_rowcol`, ``te_dist.settings.cuda_rowcol_cast``,
on by default), whose scale and history update run here as one-program kernels; else the cast of
:mod:`.triton_casts` and then the word transpose (``_transpose_bytes_kernel``) of the FP8 bytes.
Imported only through :mod:`.fused` (never at package import: CI has no Triton).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import cuda_rowcol
from .triton_casts import (_PT_TILE, UnsupportedLayout, _amax_bits, _cast_from_amax_bits, _delayed_outputs,
                           _delayed_step, _on_x_device, _roll_history, _scalar_f32, _zero_bits)
from .triton_fp8_math import _fp8_scale, _recip
from .triton_launch import cdiv, launch, next_power_of_2

__all__ = ["UnsupportedLayout", "transpose_fp8", "gather_rows_fp8", "current_scaling_quantize_rowcol",
           "cast_from_amax_rowcol", "delayed_scaling_step_rowcol"]


@triton.jit
def _scale_kernel(amax_ptr, scale_ptr, scale_inv_ptr, FMT_MAX: tl.constexpr, POWER_2: tl.constexpr):
    """The cast's scale and scale_inv from amax bits (for a cast kernel that reads its scale)."""
    scale = _fp8_scale(tl.load(amax_ptr), FMT_MAX, POWER_2)
    tl.store(scale_ptr, scale)
    tl.store(scale_inv_ptr, _recip(scale))


@triton.jit
def _roll_history_kernel(amax_ptr, hist_ptr, scale_ptr, new_hist_ptr, new_scale_ptr, new_scale_inv_ptr, hist_len,
                         margin_mul, FMT_MAX: tl.constexpr, ALGO_MAX: tl.constexpr, BLOCK: tl.constexpr,
                         ITERS: tl.constexpr):
    """:func:`_roll_history` of amax bits a cast recorded at ``amax_ptr``, as its own launch."""
    _roll_history(tl.load(amax_ptr), hist_ptr, scale_ptr, new_hist_ptr, new_scale_ptr, new_scale_inv_ptr, hist_len,
                  margin_mul, FMT_MAX, ALGO_MAX, BLOCK, ITERS)


@triton.jit
def _transpose_bytes_kernel(src_ptr, dst_ptr, idx_ptr, rows_ptr, R, C, TR: tl.constexpr, TC: tl.constexpr,
                            GATHER: tl.constexpr):
    """dst [B, C, R] = src [B, R, C], each matrix transposed (grid axis 2: B), for 1-byte elements (FP8
    data as uint8), R % 4 == 0. ``GATHER`` (one matrix): row r of the result is src row ``idx[r]`` (zero
    where ``idx[r] < 0``), and the gathered rows are also stored as they are at ``rows_ptr`` [R, C].

    Why: torch's transpose copy moves one byte per thread access (docs/quantization.md compares them).
    A program reads TR rows as four row sets (rows 4a+j, [A, 1, TC]), packs the four bytes of each
    column into one uint32 and transposes only these words, so every store is a whole word. Integers
    only: no FP8 conversion is laid out by the compiler here (Triton 3.6 places the bytes of a
    per-tensor cast writing both copies in one pass wrongly on the GPU). The gather writes both layouts
    from one read of the gathered bytes (an index_select, then this transpose, read them twice)."""
    A: tl.constexpr = TR // 4
    pid_r = tl.program_id(0)
    r3 = (pid_r.to(tl.int64) * TR + 4 * tl.arange(0, A))[:, None, None]  # first row of each word
    c = tl.program_id(1) * TC + tl.arange(0, TC)
    c3 = c[None, None, :]
    matrix = tl.program_id(2).to(tl.int64) * R * C  # both copies hold R * C bytes per matrix
    src = src_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + matrix
    w = tl.zeros((A, 1, TC), dtype=tl.uint32)
    for j in tl.static_range(4):
        inside = (c3 < C) & (r3 + j < R)
        if GATHER:
            row = tl.load(idx_ptr + r3 + j, mask=r3 + j < R, other=-1)  # the source row (int64), -1: zero
            b = tl.load(src + row * C + c3, mask=inside & (row >= 0), other=0)
            tl.store(rows_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + (r3 + j) * C + c3, b, mask=inside)
        else:
            b = tl.load(src + (r3 + j) * C + c3, mask=inside, other=0)
        w = w | (b.to(tl.uint32) << (8 * j))
    words = pid_r.to(tl.int64) * A + tl.arange(0, A)  # word index along R (row // 4)
    dst = dst_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + matrix // 4
    tl.store(dst + c[None, :, None].to(tl.int64) * (R // 4) + words[None, None, :], tl.permute(w, (1, 2, 0)),
             mask=(c < C)[None, :, None] & (words < R // 4)[None, None, :])


def _rowcol_layout(x: torch.Tensor) -> None:
    if x.dim() < 2 or x.shape[-2] % 4 or not x.numel():
        raise UnsupportedLayout(f"the per-tensor cast with a transposed copy takes a non-empty x [..., R, C] with "
                                f"R % 4 == 0, got shape {tuple(x.shape)}")


@_on_x_device
def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """``data.transpose(-1, -2).contiguous()`` for FP8 data [..., R, C] with R % 4 == 0 (each matrix of a
    stack transposed: a grouped weight's dgrad layout), in one pass of whole words."""
    _rowcol_layout(data)
    rows, cols = data.shape[-2], data.shape[-1]
    matrices = data.numel() // (rows * cols)
    out = torch.empty((*data.shape[:-2], cols, rows), dtype=data.dtype, device=data.device)
    tr, tc, warps = _PT_TILE
    data = data.contiguous()
    launch(_transpose_bytes_kernel, (cdiv(rows, tr), cdiv(cols, tc), matrices),
           data, out, data, data, rows, cols, TR=tr, TC=tc, GATHER=False, num_warps=warps)
    return out


@_on_x_device
def gather_rows_fp8(data: torch.Tensor, index: torch.Tensor, zero_rows=None):
    """``(rows, rows_t)``: ``data.index_select(0, index)`` with the rows ``zero_rows`` zero, and the same rows
    transposed (``[C, R]`` contiguous, the wgrad operand), for 2-D FP8 data and ``len(index) % 4 == 0``, in one
    pass that reads the gathered bytes once. ``index`` must lie in ``[0, len(data))``, as index_select's."""
    if data.dim() != 2 or index.dim() != 1 or not index.numel() or index.numel() % 4 or not data.numel():
        raise UnsupportedLayout(f"the FP8 row gather with a transposed copy takes 2-D data and a non-empty index of "
                                f"a multiple of 4 rows, got data {tuple(data.shape)} and index {tuple(index.shape)}")
    if index.device != data.device:  # the caller's index_select then words the error
        raise UnsupportedLayout(f"the FP8 row gather takes an index on the data's device {data.device}, "
                                f"got {index.device}")
    rows, cols = index.numel(), data.shape[1]
    source = index.to(torch.int64)
    if zero_rows is not None and zero_rows.numel():
        source = source.index_fill(0, zero_rows, -1)
    out = torch.empty((rows, cols), dtype=data.dtype, device=data.device)
    out_t = torch.empty((cols, rows), dtype=data.dtype, device=data.device)
    tr, tc, warps = _PT_TILE
    launch(_transpose_bytes_kernel, (cdiv(rows, tr), cdiv(cols, tc), 1),
           data.contiguous(), out_t, source.contiguous(), out, rows, cols, TR=tr, TC=tc, GATHER=True, num_warps=warps)
    return out, out_t


@_on_x_device
def current_scaling_quantize_rowcol(x, fp8_dtype, fmt_max: float, power_2: bool):
    """:func:`current_scaling_quantize` plus the transposed data (x [..., R, C], R % 4 == 0).
    Returns (data, data_t, scale_inv)."""
    _rowcol_layout(x)
    x = x.contiguous()
    return _cast_both_from_amax_bits(x, _amax_bits(x), fp8_dtype, fmt_max, power_2)


@_on_x_device
def cast_from_amax_rowcol(x, amax, fp8_dtype, fmt_max: float, power_2: bool):
    """:func:`cast_from_amax` plus the transposed data. Returns (data, data_t, scale_inv)."""
    _rowcol_layout(x)
    return _cast_both_from_amax_bits(x.contiguous(), _scalar_f32(amax).view(torch.int32), fp8_dtype, fmt_max,
                                     power_2)


@_on_x_device
def delayed_scaling_step_rowcol(x, scale, history, fp8_dtype, fmt_max: float, margin: int, algo: str):
    """:func:`delayed_scaling_step` plus the transposed data (x [..., R, C], R % 4 == 0).
    Returns NEW (data, data_t, history, scale, scale_inv)."""
    _rowcol_layout(x)
    if cuda_rowcol.enabled_for(x, fp8_dtype):
        return _delayed_step_one_pass(x, scale, history, fp8_dtype, fmt_max, margin, algo)
    data, *update = _delayed_step(x, scale, history, fp8_dtype, fmt_max, margin, algo)
    return (data, transpose_fp8(data), *update)


def _cast_both_from_amax_bits(x, bits, fp8_dtype, fmt_max: float, power_2: bool):
    """(data, data_t, scale_inv) of x (contiguous) cast with ``per_tensor_scale`` of the amax bits: the
    one-pass CUDA cast where it is on and fits (:mod:`.cuda_rowcol`), else the cast then the transpose."""
    if cuda_rowcol.enabled_for(x, fp8_dtype):
        scale = torch.empty(1, dtype=torch.float32, device=x.device)
        scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
        launch(_scale_kernel, (1,), bits, scale, scale_inv, FMT_MAX=fmt_max, POWER_2=power_2, num_warps=1)
        return (*cuda_rowcol.cast_rowcol(x, scale, fp8_dtype, fmt_max), scale_inv)
    data, scale_inv = _cast_from_amax_bits(x, bits, fp8_dtype, fmt_max, power_2)
    return data, transpose_fp8(data), scale_inv


def _delayed_step_one_pass(x, scale, history, fp8_dtype, fmt_max: float, margin: int, algo: str):
    """:func:`delayed_scaling_step_rowcol` on the one-pass CUDA cast: the cast records amax(x), then one
    small launch rolls the history. Returns NEW (data, data_t, history, scale, scale_inv)."""
    x = x.contiguous()
    outputs = _delayed_outputs(history, algo, x.device)
    bits = _zero_bits(x.device)
    scale = _scalar_f32(scale)
    data, data_t = cuda_rowcol.cast_rowcol(x, scale, fp8_dtype, fmt_max, amax_bits=bits)
    return (data, data_t, *roll_history(bits, scale, outputs, fmt_max, margin, algo))


def roll_history(bits, scale, outputs, fmt_max: float, margin: int, algo: str) -> tuple:
    """One small launch rolling the amax a cast recorded in ``bits`` (with ``scale``) into ``outputs``
    (``_delayed_outputs``'s). Returns NEW (history, scale, scale_inv)."""
    history, new_history, new_scale, new_scale_inv = outputs
    hist_len = history.numel()
    hist_block = min(1024, next_power_of_2(max(hist_len, 1)))
    launch(_roll_history_kernel, (1,), bits, history, scale, new_history, new_scale, new_scale_inv,
           hist_len, math.ldexp(1.0, -margin), FMT_MAX=fmt_max, ALGO_MAX=algo == "max", BLOCK=hist_block,
           ITERS=cdiv(hist_len, hist_block), num_warps=1)
    return new_history, new_scale, new_scale_inv
