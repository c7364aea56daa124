"""Fused Triton cast kernels for the FP8 recipes: one read of x, one write of each output.

Why: compiled by Inductor, the per-tensor casts take an amax pass, a cast pass and a dozen tiny
scale kernels, and the block casts become reductions that miss the bandwidth goal of issue 3
(>= 50% of a device copy). These kernels do the same math in one pass per output (per-tensor
current scaling: amax pass + cast pass, the scale computed inside the cast from device memory, no
host sync), and they are **bit-identical** to the pure functions in :mod:`.cast` run eagerly:

* torch's ``fmt_max / amax`` is ``amax.reciprocal() * fmt_max``; we compute the reciprocal in
  float64 and round it to float32, which is the correctly rounded float32 reciprocal (a quotient
  rounded to 53 bits and then to 24 bits rounds like a direct rounding), subnormal results kept;
* amaxes are maxima of ``|x|`` as int32 bit patterns (non-negative floats order like their bits,
  NaN patterns sort above Inf, so NaN propagates); per-tensor amax uses one ``atomic_max`` per program;
* clamp keeps NaN (comparisons with NaN are false), then the hardware cast rounds to nearest even;
* scale rules follow :mod:`.scaling` (fallback 1.0 / previous scale for 0, Inf, NaN amax; Inf scale ->
  largest fp32; power-of-2 rounding from the exponent bits; MX exponent from the amax bits, 2**-X
  built from bits, 0xFF code for NaN blocks).

Imported only through :mod:`.fused` (never at package import: CI has no Triton). Shapes: x
``[..., R, C]`` is viewed as ``[M = B*R, C]`` (B = product of the leading dims); the rowwise copy
keeps x's shape, the columnwise copy is ``[..., C, R]`` (each matrix transposed), both quantized
along their own last dim, exactly as :mod:`.tensors` documents.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

__all__ = [
    "compute_amax",
    "current_scaling_quantize",
    "cast_from_amax",
    "cast_and_amax",
    "delayed_scaling_step",
    "cast_fp8_blocks",
    "cast_mxfp8",
    "UnsupportedLayout",
]


class UnsupportedLayout(ValueError):
    """A valid input whose layout these kernels do not tile: ``fused.run_fused`` hands it to the
    compiled cast for that call only."""


_FP32_MAX = tl.constexpr(3.4028234663852886e38)  # largest finite float32
_F32_INF_BITS = tl.constexpr(0x7F800000)

# --------------------------------------------------------------------------- tiles (heuristics)
# Bandwidth wants many bytes in flight per SM and few registers per thread: every kernel works on
# sub-tiles of ~16 elements per thread (no spills) and loops over several of them, so one program
# still moves >= 8-16 KB of bf16 input and issues one amax atomic.
_PT_BLOCK, _PT_ITERS, _PT_WARPS = 2048, 4, 4  # per-tensor: 8192 elements per program
# 1xG blocks: group -> (sub-tile rows, groups per row, warps) for rowwise-only and for row+col
_ROWS_TILE = {128: (16, 1, 4), 32: (16, 4, 4)}
_ROWS_ITERS = 4  # rowwise-only programs cover 4 sub-tiles (64 rows)
_ROWCOL_TILE = {128: (32, 1, 8), 32: (32, 4, 8)}  # a row+col program covers G rows (one column block)
_SQUARE_TILE, _SQUARE_SUB, _SQUARE_WARPS = 128, 32, 8  # 128x128 blocks, 32-row sub-tiles


# --------------------------------------------------------------------------- device helpers
@triton.jit
def _abs_bits(x):
    """|x| as the int32 bits of its float32 value (sign cleared; NaN sorts above Inf)."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _recip(v):
    """Correctly rounded float32 ``1 / v`` (torch's reciprocal), subnormal results kept."""
    return (1.0 / v.to(tl.float64)).to(tl.float32)


@triton.jit
def _saturate(y, FMT_MAX: tl.constexpr):
    """clamp(y, -max, max) that keeps NaN, as torch.clamp does."""
    y = tl.where(y > FMT_MAX, FMT_MAX, y)
    return tl.where(y < -FMT_MAX, -FMT_MAX, y)


@triton.jit
def _inf_to_max(scale):
    """+Inf (an amax so small that fmt_max / amax overflows) -> the largest finite float32."""
    return tl.where(scale.to(tl.int32, bitcast=True) == _F32_INF_BITS, _FP32_MAX, scale)


@triton.jit
def _round_down_pow2(scale):
    bits = tl.maximum(scale.to(tl.int32, bitcast=True), 0x00800000) & 0x7F800000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_scale(amax_bits, FMT_MAX: tl.constexpr, POWER_2: tl.constexpr):
    """scaling.per_tensor_scale(amax, fmt_max, power_2=POWER_2) with margin 0 and fallback 1.0."""
    bits = amax_bits & 0x7FFFFFFF
    valid = (bits > 0) & (bits < 0x7F800000)
    amax = tl.where(valid, bits, 0x3F800000).to(tl.float32, bitcast=True)
    scale = _inf_to_max(_recip(amax) * FMT_MAX)
    scale = tl.where(valid, scale, 1.0)
    if POWER_2:
        scale = _round_down_pow2(scale)
    return scale


@triton.jit
def _block_scale(amax_bits, FMT_MAX: tl.constexpr, POWER_2: tl.constexpr, MX: tl.constexpr,
                 EMAX: tl.constexpr, MARGIN: tl.constexpr):
    """(multiplier applied to x, stored scale): FP8 blocks -> (scale, fp32 scale_inv); MX -> (2**-X, E8M0 code)."""
    if MX:
        bits = amax_bits & 0x7FFFFFFF
        biased = (bits >> 23) & 0xFF
        e = biased - 127 - EMAX + MARGIN
        e = tl.where(biased == 0, -127, e)
        e = tl.minimum(tl.maximum(e, -127), 127)
        neg = tl.minimum(tl.maximum(-e, -126), 127)
        mult = ((neg + 127) << 23).to(tl.float32, bitcast=True)
        stored = tl.where(bits > 0x7F800000, 255, e + 127).to(tl.uint8)
    else:
        mult = _fp8_scale(amax_bits, FMT_MAX, POWER_2)
        stored = _recip(mult)
    return mult, stored


# --------------------------------------------------------------------------- per-tensor kernels
@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, _abs_bits(tl.load(x_ptr + offs, mask=offs < n, other=0.0)))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _cast_per_tensor_kernel(x_ptr, out_ptr, scale_ptr, amax_ptr, scale_inv_ptr, n,
                            FMT_MAX: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr, POWER_2: tl.constexpr,
                            RECORD_AMAX: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """out = fp8(clamp(x * scale)); the scale is read from ``scale_ptr`` or derived from the amax
    bits at ``amax_ptr`` (program 0 then writes scale_inv); RECORD_AMAX accumulates amax(x) there."""
    pid = tl.program_id(0)
    if SCALE_FROM_AMAX:
        scale = _fp8_scale(tl.load(amax_ptr), FMT_MAX, POWER_2)
        if pid == 0:
            tl.store(scale_inv_ptr, _recip(scale))
    else:
        scale = tl.load(scale_ptr)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _saturate(x * scale, FMT_MAX)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
        if RECORD_AMAX:
            acc = tl.maximum(acc, _abs_bits(x))
    if RECORD_AMAX:
        tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _delayed_update_kernel(amax_ptr, hist_ptr, scale_ptr, new_hist_ptr, new_scale_ptr, new_scale_inv_ptr,
                           hist_len, margin_mul, FMT_MAX: tl.constexpr, ALGO_MAX: tl.constexpr,
                           BLOCK: tl.constexpr):
    """cast.delayed_scale_update into NEW tensors (the old scale_inv stays valid for the returned tensor)."""
    amax_bits = tl.load(amax_ptr)
    best = amax_bits
    for start in range(0, hist_len, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hist_len
        prev = tl.load(hist_ptr + offs - 1, mask=mask & (offs > 0), other=0.0)
        bits = tl.where(offs == 0, amax_bits, prev.to(tl.int32, bitcast=True))
        tl.store(new_hist_ptr + offs, bits.to(tl.float32, bitcast=True), mask=mask)
        if ALGO_MAX:
            best = tl.maximum(best, tl.max(tl.where(mask, bits & 0x7FFFFFFF, 0), axis=0))
    chosen = best & 0x7FFFFFFF
    valid = (chosen > 0) & (chosen < 0x7F800000)
    amax = tl.where(valid, chosen, 0x3F800000).to(tl.float32, bitcast=True)
    scale = _inf_to_max((_recip(amax) * FMT_MAX) * margin_mul)
    scale = tl.where(valid, scale, tl.load(scale_ptr))
    tl.store(new_scale_ptr, scale)
    tl.store(new_scale_inv_ptr, _recip(scale))


# --------------------------------------------------------------------------- block kernels
@triton.jit
def _cast_1d_blocks_kernel(x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, R, C,
                           FMT_MAX: tl.constexpr, POWER_2: tl.constexpr, MX: tl.constexpr, EMAX: tl.constexpr,
                           MARGIN: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr, NG: tl.constexpr,
                           ITERS: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr):
    """1xG blocks of x [M, C] along its rows (rowwise copy [M, C], scales [M, C/G]) and/or along its
    columns (columnwise copy [B, C, R], scales [B, C, R/G]) from one read of x.

    A program covers SUB*ITERS rows and NG*G columns, in ITERS sub-tiles [SUB, NG, G]. With COL it
    covers exactly one column block in height (SUB*ITERS == G rows, never straddling two matrices as
    R % G == 0); when a sub-tile is shorter than G, a first loop takes the column amaxes and the
    second re-reads the sub-tiles, which the first loop just brought into L2."""
    row0 = tl.program_id(0).to(tl.int64) * (SUB * ITERS)
    g = tl.program_id(1) * NG + tl.arange(0, NG)
    k = tl.arange(0, G)
    sub = tl.arange(0, SUB)
    num_g = C // G
    g3 = g[None, :, None]
    c3 = g3 * G + k[None, None, :]  # column index [1, NG, G]
    if COL:
        b = row0 // R
        rl0 = row0 - b * R
        c2 = g[:, None] * G + k[None, :]  # [NG, G]
        if SUB < G:
            col_acc = tl.zeros((NG, G), dtype=tl.int32)
            for i in range(ITERS):
                r3 = (row0 + i * SUB + sub)[:, None, None]
                x = tl.load(x_ptr + r3 * C + c3, mask=(r3 < M) & (g3 < num_g), other=0.0)
                col_acc = tl.maximum(col_acc, tl.max(_abs_bits(x), axis=0))
            col_mult, col_stored = _block_scale(col_acc, FMT_MAX, POWER_2, MX, EMAX, MARGIN)
            tl.store(col_s_ptr + b * C * (R // G) + c2 * (R // G) + rl0 // G, col_stored, mask=g[:, None] < num_g)
    for i in range(ITERS):
        r = row0 + i * SUB + sub
        r3 = r[:, None, None]
        mask = (r3 < M) & (g3 < num_g)
        x = tl.load(x_ptr + r3 * C + c3, mask=mask, other=0.0).to(tl.float32)
        bits = _abs_bits(x)
        if ROW:
            mult, stored = _block_scale(tl.max(bits, axis=2), FMT_MAX, POWER_2, MX, EMAX, MARGIN)  # [SUB, NG]
            y = _saturate(x * mult[:, :, None], FMT_MAX)
            tl.store(row_ptr + r3 * C + c3, y.to(row_ptr.dtype.element_ty), mask=mask)
            r2 = r[:, None]
            tl.store(row_s_ptr + r2 * num_g + g[None, :], stored, mask=(r2 < M) & (g[None, :] < num_g))
        if COL:
            if SUB == G:  # the sub-tile is the whole column block
                col_mult, col_stored = _block_scale(tl.max(bits, axis=0), FMT_MAX, POWER_2, MX, EMAX, MARGIN)
                tl.store(col_s_ptr + b * C * (R // G) + c2 * (R // G) + (rl0 + i * SUB) // G, col_stored,
                         mask=g[:, None] < num_g)
            y = _saturate(x * col_mult[None, :, :], FMT_MAX)
            tl.store(col_ptr + b * C * R + c3 * R + (r3 - b * R), y.to(col_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cast_square_kernel(x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, R, C,
                        FMT_MAX: tl.constexpr, POWER_2: tl.constexpr, T: tl.constexpr, SUB: tl.constexpr,
                        ROW: tl.constexpr, COL: tl.constexpr):
    """TxT blocks (one scale per tile; R and C are multiples of T): the columnwise copy is the
    rowwise one transposed, with the same scales transposed. First loop: tile amax over T/SUB
    sub-tiles; second loop: re-read them (from L2) and cast."""
    pid_r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    sub = tl.arange(0, SUB)
    c = pid_c * T + tl.arange(0, T)
    acc = tl.zeros((SUB, T), dtype=tl.int32)
    for i in range(T // SUB):
        r = pid_r * T + i * SUB + sub
        acc = tl.maximum(acc, _abs_bits(tl.load(x_ptr + r[:, None] * C + c[None, :])))
    scale = _fp8_scale(tl.max(tl.max(acc, axis=1), axis=0), FMT_MAX, POWER_2)
    scale_inv = _recip(scale)
    b = (pid_r * T) // R
    for i in range(T // SUB):
        r = pid_r * T + i * SUB + sub
        x = tl.load(x_ptr + r[:, None] * C + c[None, :]).to(tl.float32)
        y = _saturate(x * scale, FMT_MAX)
        if ROW:
            tl.store(row_ptr + r[:, None] * C + c[None, :], y.to(row_ptr.dtype.element_ty))
        if COL:
            # Transpose in registers first, so the store runs along the copy's contiguous dim: storing
            # the [SUB, T] tile through transposed addresses mis-placed FP8 elements of fp32 inputs
            # on H200 (Triton of torch 2.11), although the interpreter agreed.
            yt = tl.trans(y)
            tl.store(col_ptr + b * C * R + c[:, None] * R + (r - b * R)[None, :], yt.to(col_ptr.dtype.element_ty))
    if ROW:
        tl.store(row_s_ptr + pid_r * (C // T) + pid_c, scale_inv)
    if COL:
        tl.store(col_s_ptr + b * (C // T) * (R // T) + pid_c * (R // T) + (pid_r * T - b * R) // T, scale_inv)


# --------------------------------------------------------------------------- host wrappers
def _on_x_device(fn):
    """Launch on x's GPU (Triton launches on the *current* device, which may be another one)."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        if not x.is_cuda or x.device.index == torch.cuda.current_device():
            return fn(x, *args, **kwargs)  # the common case: no context-manager cost
        with torch.cuda.device(x.device):
            return fn(x, *args, **kwargs)

    return wrapper


def _zero_bits(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def _per_tensor_grid(n: int):
    return (max(1, triton.cdiv(n, _PT_BLOCK * _PT_ITERS)),)


def _launch_cast(x, out, *, scale=None, amax_bits=None, scale_inv=None, fmt_max, from_amax, power_2, record):
    dummy = amax_bits if amax_bits is not None else scale
    _cast_per_tensor_kernel[_per_tensor_grid(x.numel())](
        x, out, scale if scale is not None else dummy, amax_bits if amax_bits is not None else dummy,
        scale_inv if scale_inv is not None else dummy, x.numel(),
        FMT_MAX=fmt_max, SCALE_FROM_AMAX=from_amax, POWER_2=power_2, RECORD_AMAX=record,
        BLOCK=_PT_BLOCK, ITERS=_PT_ITERS, num_warps=_PT_WARPS,
    )


def _amax_bits(x: torch.Tensor) -> torch.Tensor:
    bits = _zero_bits(x.device)
    if x.numel():
        _amax_kernel[_per_tensor_grid(x.numel())](x, bits, x.numel(), BLOCK=_PT_BLOCK, ITERS=_PT_ITERS,
                                                  num_warps=_PT_WARPS)
    return bits


@_on_x_device
def compute_amax(x: torch.Tensor) -> torch.Tensor:
    """scaling.compute_amax: max|x| as a float32 0-dim tensor (NaN if x holds one)."""
    return _amax_bits(x.contiguous()).view(torch.float32).reshape(())


def _cast_from_amax_bits(x, bits, fp8_dtype, fmt_max: float, power_2: bool):
    """The cast pass: the kernel derives ``per_tensor_scale`` from amax bits in device memory."""
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    _launch_cast(x, data, amax_bits=bits, scale_inv=scale_inv, fmt_max=fmt_max, from_amax=True,
                 power_2=power_2, record=False)
    return data, scale_inv


@_on_x_device
def cast_from_amax(x, amax, fp8_dtype, fmt_max: float, power_2: bool):
    """Cast with ``per_tensor_scale(amax)`` computed on the device (amax: float32, e.g. all-reduced).
    Returns (data, scale_inv)."""
    bits = amax.to(torch.float32).reshape(1).contiguous().view(torch.int32)
    return _cast_from_amax_bits(x.contiguous(), bits, fp8_dtype, fmt_max, power_2)


@_on_x_device
def current_scaling_quantize(x, fp8_dtype, fmt_max: float, power_2: bool):
    """cast.current_scaling_quantize: amax pass + cast pass, no host sync. Returns (data, scale_inv)."""
    x = x.contiguous()
    return _cast_from_amax_bits(x, _amax_bits(x), fp8_dtype, fmt_max, power_2)


@_on_x_device
def cast_and_amax(x, scale, fp8_dtype, fmt_max: float):
    """cast.cast_fp8_per_tensor plus amax(x) from the same pass. Returns (data, amax float32 0-dim)."""
    x = x.contiguous()
    bits = _zero_bits(x.device)
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    _launch_cast(x, data, scale=scale.to(torch.float32).reshape(1).contiguous(), amax_bits=bits,
                 fmt_max=fmt_max, from_amax=False, power_2=False, record=True)
    return data, bits.view(torch.float32).reshape(())


@_on_x_device
def delayed_scaling_step(x, scale, history, fp8_dtype, fmt_max: float, margin: int, algo: str):
    """cast.delayed_scaling_step: one cast+amax pass, then one tiny update kernel.
    Returns NEW (data, history, scale, scale_inv); the inputs are not modified."""
    if algo not in ("max", "most_recent"):
        raise ValueError(f"fused delayed scaling supports amax_compute_algo 'max' or 'most_recent', got {algo!r}")
    data, amax = cast_and_amax(x, scale, fp8_dtype, fmt_max)
    history = history.to(torch.float32).contiguous()
    new_history = torch.empty_like(history)
    new_scale = torch.empty((), dtype=torch.float32, device=x.device)
    new_scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    hist_len = history.numel()
    block = min(1024, triton.next_power_of_2(max(hist_len, 1)))
    _delayed_update_kernel[(1,)](
        amax.reshape(1).view(torch.int32), history, scale.to(torch.float32).reshape(1).contiguous(),
        new_history, new_scale, new_scale_inv, hist_len, math.ldexp(1.0, -margin),
        FMT_MAX=fmt_max, ALGO_MAX=algo == "max", BLOCK=block,
    )
    return data, new_history, new_scale, new_scale_inv


def _split_shape(x: torch.Tensor):
    *lead, rows, cols = x.shape
    return tuple(lead), math.prod(lead) * rows, rows, cols


def _one_d_blocks(x, group, fp8_dtype, fmt_max, *, power_2, mx, emax, margin, scale_dtype, rowwise, columnwise):
    """Shared driver of the 1xG casts (Float8 1x128, MXFP8 1x32)."""
    x = x.contiguous()
    lead, m, rows, cols = _split_shape(x)
    if cols % group or (columnwise and rows % group):
        # e.g. a columnwise-only copy of x[32, 16] with 1x32 blocks: valid, but these kernels tile x's
        # columns in whole blocks; the compiled cast handles it.
        raise UnsupportedLayout(f"fused 1x{group} casts need both dims of x {tuple(x.shape)} to tile {group}")
    dev = x.device
    row = col = (None, None)
    if rowwise:
        row = (torch.empty(x.shape, dtype=fp8_dtype, device=dev),
               torch.empty((*lead, rows, cols // group), dtype=scale_dtype, device=dev))
    if columnwise:
        col = (torch.empty((*lead, cols, rows), dtype=fp8_dtype, device=dev),
               torch.empty((*lead, cols, rows // group), dtype=scale_dtype, device=dev))
    if m == 0 or cols == 0:
        return (*row, *col)
    consts = dict(FMT_MAX=fmt_max, POWER_2=power_2, MX=mx, EMAX=emax, MARGIN=margin, G=group)
    if columnwise:
        sub, ng, warps = _ROWCOL_TILE[group]
        iters = group // sub
    else:
        sub, ng, warps = _ROWS_TILE[group]
        iters = _ROWS_ITERS
    grid = (triton.cdiv(m, sub * iters), triton.cdiv(cols // group, ng))
    row_data, row_s = row if rowwise else col  # placeholders when a copy is off (never written)
    col_data, col_s = col if columnwise else row
    _cast_1d_blocks_kernel[grid](x, row_data, row_s, col_data, col_s, m, rows, cols, SUB=sub, NG=ng, ITERS=iters,
                                 ROW=rowwise, COL=columnwise, num_warps=warps, **consts)
    return (*row, *col)


@_on_x_device
def cast_fp8_blocks(x, block_rows: int, block_cols: int, fp8_dtype, fmt_max: float, power_2: bool, *,
                    rowwise: bool = True, columnwise: bool = False):
    """cast.cast_fp8_blocks for 1x128 and 128x128 blocks, rowwise and/or columnwise in one pass.

    Returns (row_data, row_scale_inv, col_data, col_scale_inv) (None for a copy not asked for);
    the columnwise copy equals ``cast.cast_fp8_blocks(x.transpose(-1, -2), ...)``."""
    if (block_rows, block_cols) == (1, 128):
        return _one_d_blocks(x, 128, fp8_dtype, fmt_max, power_2=power_2, mx=False, emax=0, margin=0,
                             scale_dtype=torch.float32, rowwise=rowwise, columnwise=columnwise)
    if (block_rows, block_cols) != (_SQUARE_TILE, _SQUARE_TILE):
        raise ValueError(f"fused FP8 block casts support 1x128 and 128x128 blocks, got {block_rows}x{block_cols}")
    x = x.contiguous()
    lead, m, rows, cols = _split_shape(x)
    t = _SQUARE_TILE
    if rows % t or cols % t:
        raise UnsupportedLayout(f"fused {t}x{t} casts need both dims of x {tuple(x.shape)} to tile {t}")
    dev = x.device
    row = col = (None, None)
    if rowwise:
        row = (torch.empty(x.shape, dtype=fp8_dtype, device=dev),
               torch.empty((*lead, rows // t, cols // t), dtype=torch.float32, device=dev))
    if columnwise:
        col = (torch.empty((*lead, cols, rows), dtype=fp8_dtype, device=dev),
               torch.empty((*lead, cols // t, rows // t), dtype=torch.float32, device=dev))
    if m and cols:
        row_data, row_s = row if rowwise else col
        col_data, col_s = col if columnwise else row
        _cast_square_kernel[(m // t, cols // t)](
            x, row_data, row_s, col_data, col_s, rows, cols, FMT_MAX=fmt_max, POWER_2=power_2, T=t,
            SUB=_SQUARE_SUB, ROW=rowwise, COL=columnwise, num_warps=_SQUARE_WARPS,
        )
    return (*row, *col)


@_on_x_device
def cast_mxfp8(x, fp8_dtype, fmt_max: float, emax_elem: int, margin: int, *, rowwise: bool = True,
               columnwise: bool = False):
    """cast.cast_mxfp8 with 1x32 blocks, rowwise and/or columnwise in one pass.

    Returns (row_data, row_codes, col_data, col_codes), codes as uint8 E8M0 bytes."""
    return _one_d_blocks(x, 32, fp8_dtype, fmt_max, power_2=False, mx=True, emax=emax_elem, margin=margin,
                         scale_dtype=torch.uint8, rowwise=rowwise, columnwise=columnwise)
