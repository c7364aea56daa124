"""AdamW's update of a grouped weight that also writes the weight's FP8 copy (delayed, current or 128x128 blocks).

Why: a training step casts every expert weight once (read bf16, write FP8 in both GEMM layouts, 4 bytes per element),
right after the optimizer read and wrote the same weight. Here the update writes the copy from the values it just
rounded to bf16, so the cast costs its 2 bytes of writes alone (te_dist.optim says who may use the copy).

The copy's bytes are the cast's of the updated weight: delayed scaling's
(:func:`.triton_rowcol.delayed_scaling_step_rowcol`) with the quantizer's scale, amax(w) recorded as int32 bits, then
the same history roll; or the 128x128 block cast's (:func:`.triton_casts.cast_fp8_blocks`), each program one block:
its amax, its scale, both copies and their scales; or current scaling's, whose scale needs the updated weight's
amax: the update records it, then the one-pass cast from that amax reads the weight once more. The update is ``torch.optim.AdamW``'s (decoupled weight decay,
bias-corrected moments) in float32 on the parameter's dtype. Imported only through
:func:`te_dist.quantization.optimizer_copy.copy_kernels_for` (Triton).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_casts import _delayed_outputs, _scalar_f32, _zero_bits
from .triton_fp8_math import _abs_bits, _block_scale, _merge_amax, _saturate
from .triton_launch import cdiv, launch
from .triton_rowcol import cast_from_amax_rowcol, roll_history

__all__ = ["adamw_delayed_copy", "adamw_current_copy", "adamw_block_copy"]

_TILE = 64  # rows and columns of one program's tile


@triton.jit
def _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, at, inside, decay, beta1, beta2, eps, step_size, bc2_sqrt):
    """AdamW's step of one tile (w, m, v stored in their dtypes); returns w as stored, in float32."""
    p = tl.load(p_ptr + at, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + at, mask=inside, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + at, mask=inside, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + at, mask=inside, other=0.0).to(tl.float32)
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    w = p.to(p_ptr.dtype.element_ty)
    tl.store(p_ptr + at, w, mask=inside)
    tl.store(m_ptr + at, m.to(m_ptr.dtype.element_ty), mask=inside)
    tl.store(v_ptr + at, v.to(v_ptr.dtype.element_ty), mask=inside)
    return w.to(tl.float32)


@triton.jit
def _adamw_block_kernel(p_ptr, g_ptr, m_ptr, v_ptr, data_ptr, data_t_ptr, scale_ptr, scale_t_ptr, R, C, RP, CP,
                        decay, beta1, beta2, eps, step_size, bc2_sqrt, FMT_MAX: tl.constexpr,
                        POWER_2: tl.constexpr, TILE: tl.constexpr):
    """One 128x128 block of matrix ``pid 2`` of w [E, R, C]: update w, m, v; write the block's copies of w zero
    padded to [E, RP, CP] (RP, CP: R, C up to multiples of 128; data [E, RP, CP], data_t [E, CP, RP]) and its
    scale_inv into [E, RP/128, CP/128] and [E, CP/128, RP/128]."""
    e = tl.program_id(2).to(tl.int64)
    rb, cb = tl.program_id(0), tl.program_id(1)
    rows = rb * TILE + tl.arange(0, TILE)
    cols = cb * TILE + tl.arange(0, TILE)
    inside = (rows[:, None] < R) & (cols[None, :] < C)
    at = e * R * C + rows[:, None].to(tl.int64) * C + cols[None, :]
    x = _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, at, inside, decay, beta1, beta2, eps, step_size, bc2_sqrt)
    x = tl.where(inside, x, 0.0)  # the padding: zeros
    mult, stored = _block_scale(tl.max(tl.max(_abs_bits(x), axis=1), axis=0), FMT_MAX, POWER_2, False, 0, 0)
    q = _saturate(x * mult, FMT_MAX).to(data_ptr.dtype.element_ty)
    tl.store(data_ptr + e * RP * CP + rows[:, None].to(tl.int64) * CP + cols[None, :], q)
    at_t = e * RP * CP + cols[None, :].to(tl.int64) * RP + rows[:, None]
    tl.store(data_t_ptr + tl.trans(at_t), tl.trans(q))
    nr, nc = RP // TILE, CP // TILE
    tl.store(scale_ptr + (e * nr + rb) * nc + cb, stored)
    tl.store(scale_t_ptr + (e * nc + cb) * nr + rb, stored)


@triton.jit
def _adamw_copy_kernel(p_ptr, g_ptr, m_ptr, v_ptr, data_ptr, data_t_ptr, scale_ptr, amax_ptr, R, C,
                       decay, beta1, beta2, eps, step_size, bc2_sqrt, FMT_MAX: tl.constexpr, TILE: tl.constexpr,
                       CAST: tl.constexpr):
    """One [TILE, TILE] tile of matrix ``pid 2`` of w [E, R, C]: update w, m, v; merge max |w| into the amax bits;
    with ``CAST`` write fp8(w * scale) to data [E, R, C] and data_t [E, C, R]."""
    e = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    inside = (rows[:, None] < R) & (cols[None, :] < C)
    at = e * R * C + rows[:, None].to(tl.int64) * C + cols[None, :]
    x = _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, at, inside, decay, beta1, beta2, eps, step_size, bc2_sqrt)
    _merge_amax(amax_ptr, tl.max(tl.max(tl.where(inside, _abs_bits(x), 0), axis=1), axis=0))
    if CAST:
        q = _saturate(x * tl.load(scale_ptr), FMT_MAX).to(data_ptr.dtype.element_ty)
        tl.store(data_ptr + at, q, mask=inside)
        at_t = e * R * C + cols[None, :].to(tl.int64) * R + rows[:, None]
        tl.store(data_t_ptr + tl.trans(at_t), tl.trans(q), mask=tl.trans(inside))


def adamw_delayed_copy(p, grad, exp_avg, exp_avg_sq, *, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, step: int, scale, history, fp8_dtype, fmt_max: float, margin: int,
                       algo: str):
    """One AdamW step of ``p`` [E, R, C] (its moments updated in place) and the delayed-scaling copy of the result.
    Returns NEW (data [E, R, C], data_t [E, C, R], history, scale, scale_inv), as the delayed cast does."""
    E, R, C = p.shape
    outputs = _delayed_outputs(history, algo, p.device)
    scale = _scalar_f32(scale)
    data = torch.empty(p.shape, dtype=fp8_dtype, device=p.device)
    data_t = torch.empty((E, C, R), dtype=fp8_dtype, device=p.device)
    bits = _zero_bits(p.device)
    launch(_adamw_copy_kernel, (cdiv(R, _TILE), cdiv(C, _TILE), E), p, grad, exp_avg, exp_avg_sq, data, data_t,
           scale, bits, R, C, *_hyper(lr, beta1, beta2, eps, weight_decay, step), FMT_MAX=fmt_max, TILE=_TILE,
           CAST=True, num_warps=4)
    return (data, data_t, *roll_history(bits, scale, outputs, fmt_max, margin, algo))


def adamw_current_copy(p, grad, exp_avg, exp_avg_sq, *, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, step: int, fp8_dtype, fmt_max: float, power_2: bool):
    """One AdamW step of ``p`` [E, R, C] that records amax of the result, then current scaling's cast of it from
    that amax (its scale needs the whole weight's amax first: a second pass, but no amax pass). Returns
    (data, data_t, scale_inv), as ``cast_from_amax_rowcol`` does."""
    E, R, C = p.shape
    bits = _zero_bits(p.device)
    launch(_adamw_copy_kernel, (cdiv(R, _TILE), cdiv(C, _TILE), E), p, grad, exp_avg, exp_avg_sq, p, p, bits, bits,
           R, C, *_hyper(lr, beta1, beta2, eps, weight_decay, step), FMT_MAX=fmt_max, TILE=_TILE, CAST=False,
           num_warps=4)
    return cast_from_amax_rowcol(p, bits.view(torch.float32), fp8_dtype, fmt_max, power_2)


def adamw_block_copy(p, grad, exp_avg, exp_avg_sq, *, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, step: int, fp8_dtype, fmt_max: float, power_2: bool):
    """One AdamW step of ``p`` [E, R, C] (its moments updated in place) and the 128x128 block copies of the result
    zero padded to [E, RP, CP] (R and C up to multiples of 128: the padded weight's cast, where they are off that
    grid). Returns (data, scale_inv, data_t, scale_inv_t), as ``cast_fp8_blocks`` of the padded weight does."""
    E, R, C = p.shape
    t = 128
    RP, CP = cdiv(R, t) * t, cdiv(C, t) * t
    data = torch.empty((E, RP, CP), dtype=fp8_dtype, device=p.device)
    data_t = torch.empty((E, CP, RP), dtype=fp8_dtype, device=p.device)
    scale = torch.empty((E, RP // t, CP // t), dtype=torch.float32, device=p.device)
    scale_t = torch.empty((E, CP // t, RP // t), dtype=torch.float32, device=p.device)
    launch(_adamw_block_kernel, (RP // t, CP // t, E), p, grad, exp_avg, exp_avg_sq, data, data_t, scale, scale_t,
           R, C, RP, CP, *_hyper(lr, beta1, beta2, eps, weight_decay, step), FMT_MAX=fmt_max, POWER_2=power_2,
           TILE=t, num_warps=16)  # 128x128 fp32 values of four tensors: 128 registers a thread
    return data, scale, data_t, scale_t


def _hyper(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> tuple:
    """(decay, beta1, beta2, eps, step size, sqrt of the second bias correction) as the kernels take them."""
    return 1.0 - lr * weight_decay, beta1, beta2, eps, lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step)
