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
  NaN patterns sort above Inf, so NaN propagates); per-tensor amax uses one *relaxed* ``atomic_max``
  per program (its reader is a later kernel, so no fence is needed: an acq_rel atomic after the
  stores made every program wait for its own writes);
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
    "cast_nvfp4",
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
# rowwise-only 1xG blocks are consecutive runs of G elements in memory: the kernel streams x as a flat
# [blocks, G] array. group -> (blocks per sub-tile, sub-tiles per program, warps): 2048 elements per sub-tile
_ROWS_TILE = {128: (16, 4, 4), 32: (64, 4, 4)}
# G-row tiles (_cast_tile_kernel): a program owns G rows x NG*G columns in sub-tiles of SUB rows;
# (group, square) -> (NG, SUB, warps). Rows+columns of 1xG blocks, and 128x128 blocks (either copy).
_TILE = {(128, False): (1, 64, 4), (32, False): (8, 32, 4), (128, True): (1, 64, 4)}
_NVFP4_ROWS = (128, 4, 4)  # 1x16 NVFP4: (blocks per sub-tile, sub-tiles per program, warps)
_NVFP4_2D = (16, 4)  # 16x16 NVFP4: (tiles per program along the columns, warps)
# group -> True: a row+col cast runs the rowwise kernel, then the tile kernel for the columnwise copy
# only (x read twice, fewer reductions per tile); False: one tile kernel writes both copies
_ROWCOL_SPLIT = {128: False, 32: False}


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
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0), sem="relaxed")


@triton.jit
def _cast_per_tensor_kernel(x_ptr, out_ptr, scale_ptr, amax_ptr, scale_inv_ptr, n,
                            FMT_MAX: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr, POWER_2: tl.constexpr,
                            RECORD_AMAX: tl.constexpr, REVERSE: tl.constexpr, BLOCK: tl.constexpr,
                            ITERS: tl.constexpr):
    """out = fp8(clamp(x * scale)); the scale is read from ``scale_ptr`` or derived from the amax
    bits at ``amax_ptr`` (program 0 then writes scale_inv); RECORD_AMAX accumulates amax(x) there.

    REVERSE walks x from its end: right after an amax pass, the tail that pass read last is still
    in L2, so the cast's first programs read it from there instead of from HBM."""
    pid = tl.program_id(0)
    chunk = tl.num_programs(0) - 1 - pid if REVERSE else pid
    if SCALE_FROM_AMAX:
        scale = _fp8_scale(tl.load(amax_ptr), FMT_MAX, POWER_2)
        if pid == 0:
            tl.store(scale_inv_ptr, _recip(scale))
    else:
        scale = tl.load(scale_ptr)
    base = chunk.to(tl.int64) * (BLOCK * ITERS)
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
        tl.atomic_max(amax_ptr, tl.max(acc, axis=0), sem="relaxed")


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
def _cast_rows_kernel(x_ptr, out_ptr, s_ptr, nblocks, FMT_MAX: tl.constexpr, POWER_2: tl.constexpr,
                      MX: tl.constexpr, EMAX: tl.constexpr, MARGIN: tl.constexpr, G: tl.constexpr,
                      NB: tl.constexpr, ITERS: tl.constexpr):
    """Rowwise 1xG blocks (C % G == 0): block j is x.flat[j*G:(j+1)*G] and its scale is s.flat[j], so x
    streams as a flat [nblocks, G] array, NB blocks per sub-tile, ITERS sub-tiles per program."""
    base = tl.program_id(0).to(tl.int64) * (NB * ITERS)
    k = tl.arange(0, G)
    for i in range(ITERS):
        blk = base + i * NB + tl.arange(0, NB)
        mask = blk < nblocks
        offs = blk[:, None] * G + k[None, :]
        x = tl.load(x_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)
        mult, stored = _block_scale(tl.max(_abs_bits(x), axis=1), FMT_MAX, POWER_2, MX, EMAX, MARGIN)
        y = _saturate(x * mult[:, None], FMT_MAX)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask[:, None])
        tl.store(s_ptr + blk, stored, mask=mask)


@triton.jit
def _load_rows(x_ptr, r, C, c3, mask):
    """x[r, c3] as float32, r: [A] row indices, c3: [1, NG, G] column indices -> [A, NG, G]."""
    return tl.load(x_ptr + r[:, None, None] * C + c3, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _abs_bits4(x0, x1, x2, x3):
    """Elementwise max of |x_j| bits over the four row sets of a sub-tile ([A, NG, G]; reduced later,
    once: a reduction over rows crosses warps and costs a barrier)."""
    return tl.maximum(tl.maximum(_abs_bits(x0), _abs_bits(x1)), tl.maximum(_abs_bits(x2), _abs_bits(x3)))


@triton.jit
def _store_rowwise(x, r, row_ptr, row_s_ptr, C, c3, g, num_g, mask, sq_mult, FMT_MAX: tl.constexpr,
                   POWER_2: tl.constexpr, MX: tl.constexpr, EMAX: tl.constexpr, MARGIN: tl.constexpr,
                   SQUARE: tl.constexpr):
    """The rowwise copy of rows r ([A, NG, G] tile x): 1xG block scales per row, or the square tile's."""
    if SQUARE:
        mult = sq_mult[None, :, None]
    else:
        m, stored = _block_scale(tl.max(_abs_bits(x), axis=2), FMT_MAX, POWER_2, MX, EMAX, MARGIN)  # [A, NG]
        tl.store(row_s_ptr + r[:, None] * num_g + g[None, :], stored, mask=g[None, :] < num_g)
        mult = m[:, :, None]
    y = _saturate(x * mult, FMT_MAX)
    tl.store(row_ptr + r[:, None, None] * C + c3, y.to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_byte(x, mult, FMT_MAX: tl.constexpr, FP8: tl.constexpr):
    """fp8(clamp(x * mult)) as its byte, widened to uint32 for packing."""
    return _saturate(x * mult, FMT_MAX).to(FP8).to(tl.uint8, bitcast=True).to(tl.uint32)


@triton.jit
def _cast_tile_kernel(x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, R, C,
                      FMT_MAX: tl.constexpr, POWER_2: tl.constexpr, MX: tl.constexpr, EMAX: tl.constexpr,
                      MARGIN: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, SUB: tl.constexpr,
                      ROW: tl.constexpr, COL: tl.constexpr, SQUARE: tl.constexpr):
    """Casts that need a G-row tile: the columnwise copy of 1xG blocks (COL, plus the rowwise copy with
    ROW) and GxG square blocks (SQUARE: one scale per tile, either copy). R % G == 0, C % G == 0.

    A program owns G rows of one matrix and NG*G columns, in sub-tiles of SUB rows. A sub-tile is read
    as four row sets x_j = rows 4a+j, each [SUB/4, NG, G] (row, group, column in group): row amaxes
    reduce axis 2, column amaxes axis 0 and the four sets. When a scale needs more rows than one
    sub-tile holds (SUB < G, or a square tile), a first loop takes the amaxes and the second re-reads
    the sub-tiles, which the first just brought into L2.

    The columnwise copy [B, C, R] is cast in the load layout (as the rowwise copy), then the four FP8
    bytes of rows 4a..4a+3 of each column are packed into one uint32, and only these words are
    transposed ([NG, G, SUB/4]) and stored, rows contiguous. Why: transposing single bytes through
    shared memory hit bank conflicts (a row+col cast ran at 0.22 of copy bandwidth on H200), and
    converting a transposed float32 tile to FP8 mis-placed elements with Triton 3.6."""
    row0 = tl.program_id(0).to(tl.int64) * G
    b = row0 // R
    rl0 = row0 - b * R
    A: tl.constexpr = SUB // 4
    a4 = 4 * tl.arange(0, A)
    g = tl.program_id(1) * NG + tl.arange(0, NG)
    k = tl.arange(0, G)
    num_g = C // G
    c3 = g[None, :, None] * G + k[None, None, :]  # [1, NG, G]
    mask = g[None, :, None] < num_g
    c2 = g[:, None] * G + k[None, :]  # [NG, G]
    FP8: tl.constexpr = col_ptr.dtype.element_ty  # the row copy's type when COL is off (same placeholder)
    sq_mult = tl.full((NG,), 1.0, dtype=tl.float32)
    col_mult = tl.full((NG, G), 1.0, dtype=tl.float32)
    if SQUARE or SUB < G:  # scales over more rows than one sub-tile: amaxes first
        acc3 = tl.zeros((A, NG, G), dtype=tl.int32)
        for i in range(G // SUB):
            r = row0 + i * SUB + a4
            acc3 = tl.maximum(acc3, _abs_bits4(_load_rows(x_ptr, r, C, c3, mask), _load_rows(x_ptr, r + 1, C, c3, mask),
                                               _load_rows(x_ptr, r + 2, C, c3, mask),
                                               _load_rows(x_ptr, r + 3, C, c3, mask)))
        acc = tl.max(acc3, axis=0)  # [NG, G]
        if SQUARE:
            sq_mult, sq_stored = _block_scale(tl.max(acc, axis=1), FMT_MAX, POWER_2, MX, EMAX, MARGIN)  # [NG]
            # the columnwise copy takes the [NG, G] scale path of 1xG blocks: with a [NG] scale
            # broadcast into the packed-word cast, Triton 3.6 produced wrong bytes on H200
            col_mult = tl.zeros((NG, G), dtype=tl.float32) + sq_mult[:, None]
            if ROW:
                tl.store(row_s_ptr + (row0 // G) * num_g + g, sq_stored, mask=g < num_g)
            if COL:
                tl.store(col_s_ptr + b * num_g * (R // G) + g * (R // G) + rl0 // G, sq_stored, mask=g < num_g)
        else:
            col_mult, col_stored = _block_scale(acc, FMT_MAX, POWER_2, MX, EMAX, MARGIN)
            tl.store(col_s_ptr + b * C * (R // G) + c2 * (R // G) + rl0 // G, col_stored, mask=g[:, None] < num_g)
    col_w = col_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    for i in range(G // SUB):
        r = row0 + i * SUB + a4
        x0 = _load_rows(x_ptr, r, C, c3, mask)
        x1 = _load_rows(x_ptr, r + 1, C, c3, mask)
        x2 = _load_rows(x_ptr, r + 2, C, c3, mask)
        x3 = _load_rows(x_ptr, r + 3, C, c3, mask)
        if ROW:
            _store_rowwise(x0, r, row_ptr, row_s_ptr, C, c3, g, num_g, mask, sq_mult, FMT_MAX, POWER_2, MX, EMAX,
                           MARGIN, SQUARE)
            _store_rowwise(x1, r + 1, row_ptr, row_s_ptr, C, c3, g, num_g, mask, sq_mult, FMT_MAX, POWER_2, MX, EMAX,
                           MARGIN, SQUARE)
            _store_rowwise(x2, r + 2, row_ptr, row_s_ptr, C, c3, g, num_g, mask, sq_mult, FMT_MAX, POWER_2, MX, EMAX,
                           MARGIN, SQUARE)
            _store_rowwise(x3, r + 3, row_ptr, row_s_ptr, C, c3, g, num_g, mask, sq_mult, FMT_MAX, POWER_2, MX, EMAX,
                           MARGIN, SQUARE)
        if COL:
            if SUB == G and not SQUARE:  # the sub-tile is the whole column block
                col_mult, col_stored = _block_scale(tl.max(_abs_bits4(x0, x1, x2, x3), axis=0), FMT_MAX, POWER_2, MX,
                                                    EMAX, MARGIN)
                tl.store(col_s_ptr + b * C * (R // G) + c2 * (R // G) + rl0 // G, col_stored,
                         mask=g[:, None] < num_g)
                mult = col_mult[None, :, :]
            else:
                mult = col_mult[None, :, :]
            w = (_fp8_byte(x0, mult, FMT_MAX, FP8) | (_fp8_byte(x1, mult, FMT_MAX, FP8) << 8)
                 | (_fp8_byte(x2, mult, FMT_MAX, FP8) << 16) | (_fp8_byte(x3, mult, FMT_MAX, FP8) << 24))
            wt = tl.permute(w, (1, 2, 0))  # [NG, G (column), SUB/4 (row word)]
            # word index from an arange (not from r // 4), so Triton sees the run and vectorizes the store
            words = b * (C * (R // 4)) + c2[:, :, None] * (R // 4) + ((rl0 + i * SUB) // 4 + tl.arange(0, A))[None, None, :]
            tl.store(col_w + words, wt, mask=g[:, None, None] < num_g)


# --------------------------------------------------------------------------- NVFP4 kernels
_NVFP4_ENC_MAX = tl.constexpr(2688.0)  # 448 (largest E4M3 block scale) * 6 (largest E2M1 element)


@triton.jit
def _nvfp4_block_scale(block_amax, s_enc):
    """scaling.nvfp4_block_scales: (E4M3 decode scale, float32 factor onto the E2M1 grid)."""
    decode = (block_amax * (1.0 / 6.0)) * s_enc  # fp32(1/6), as the reference (same on CPU and GPU)
    decode = tl.where(decode > 448.0, 448.0, decode)  # keeps NaN
    scale8 = decode.to(tl.float8e4nv)
    scale_f = scale8.to(tl.float32)
    pos = scale_f > 0.0
    factor = tl.where(pos, (s_enc.to(tl.float64) / tl.where(pos, scale_f, 1.0).to(tl.float64)).to(tl.float32), 0.0)
    factor = tl.where(scale_f != scale_f, float("nan"), factor)
    return scale8, factor


@triton.jit
def _e2m1_nibbles(scaled, noise, SR: tl.constexpr):
    """e2m1.round_to_e2m1_codes (or stochastic_round_to_e2m1_codes with ``noise`` in [0, 1)),
    sign in bit 3 (from the float's sign bit: -0.0 keeps it)."""
    a = tl.abs(scaled)
    if SR:
        a = tl.where(a > 6.0, 6.0, a)  # clamp(max=6) keeps NaN
        lo = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32) + (a >= 2.0).to(tl.int32)
              + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32) + (a >= 6.0).to(tl.int32))
        hi = tl.minimum(lo + 1, 7)
        # the grid gaps are powers of two (0.5 below 2, 1 below 4, 2 below 6, none at 6), so the
        # reference's (a - lo) / gap is exactly this product (a - lo is exact: Sterbenz)
        inv_gap = tl.where(lo < 4, 2.0, tl.where(lo < 6, 1.0, tl.where(lo < 7, 0.5, 0.0)))
        frac = (a - _e2m1_magnitude(lo)) * inv_gap
        code = tl.where(noise < frac, hi, lo)
        code = tl.where(scaled != scaled, 0, code)
    else:
        code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    # NaN -> nibble 0 (E2M1 has no NaN; the block's NaN scale shows it): what the reference gets on
    # the GPU, whose float ops return the positive canonical NaN
    sign = tl.where(scaled != scaled, 0, (scaled.to(tl.int32, bitcast=True) >> 28) & 8)
    return code | sign


@triton.jit
def _e2m1_magnitude(code):
    """Magnitude of a 3-bit E2M1 code (e2m1._code_magnitudes), exact."""
    e = code >> 1
    m = (code & 1).to(tl.float32)
    normal = (1.0 + 0.5 * m) * ((e + 126) << 23).to(tl.float32, bitcast=True)  # (1 + m/2) * 2**(e-1)
    return tl.where(e == 0, 0.5 * m, normal)


@triton.jit
def _noise16(seed, chunk):
    """Uniform noise in [0, 1) on a 2**-16 grid for the 8 consecutive elements of each ``chunk`` id
    ([..., 2] ids -> [..., 16] values, element 8c + 2w + h from half h of Philox word w of chunk c).

    Why not ``tl.rand`` per element: one Philox call (10 rounds) per element made the stochastic cast
    compute-bound; one call yields 128 bits, enough for 8 elements at 16 bits. The 16-bit grid biases
    the rounding probability by < 2**-16 of a grid gap."""
    r0, r1, r2, r3 = tl.randint4x(seed, chunk)
    words = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [..., 2, 2 (outer), 2 (inner)]: word 2*outer + inner
    halves = tl.join(words & 0xFFFF, words >> 16)  # [..., 2, 2, 2, 2]
    return tl.reshape(halves, chunk.shape[:-1] + [16]).to(tl.float32) * (1.0 / 65536.0)


@triton.jit
def _pack_nibbles(nib, SHAPE0: tl.constexpr, SHAPE1: tl.constexpr):
    """[SHAPE0, SHAPE1] nibbles -> [SHAPE0, SHAPE1 / 2] bytes: element 2i low, 2i+1 high (e2m1.pack_e2m1)."""
    lo, hi = tl.split(tl.reshape(nib, (SHAPE0, SHAPE1 // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _cast_nvfp4_rows_kernel(x_ptr, out_ptr, s_ptr, amax_ptr, s_inv_ptr, nblocks, seed, NB: tl.constexpr,
                            ITERS: tl.constexpr, SR: tl.constexpr):
    """Rowwise 1x16 NVFP4 blocks of x streamed as flat [nblocks, 16]; the tensor scale comes from the
    amax bits in device memory (program 0 writes its inverse). Walks x backwards, like the per-tensor
    FP8 cast after its amax pass (x's tail is still in L2)."""
    s_enc = _fp8_scale(tl.load(amax_ptr), _NVFP4_ENC_MAX, False)
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(s_inv_ptr, _recip(s_enc))
    base = (tl.num_programs(0) - 1 - pid).to(tl.int64) * (NB * ITERS)
    k = tl.arange(0, 16)
    p = tl.arange(0, 8)
    for i in range(ITERS):
        blk = base + i * NB + tl.arange(0, NB)
        mask = blk < nblocks
        offs = blk[:, None] * 16 + k[None, :]
        x = tl.load(x_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)
        block_amax = tl.max(_abs_bits(x), axis=1).to(tl.float32, bitcast=True)
        scale8, factor = _nvfp4_block_scale(block_amax, s_enc)
        noise = _noise16(seed, blk[:, None] * 2 + tl.arange(0, 2)[None, :]) if SR else x
        nib = _e2m1_nibbles(x * factor[:, None], noise, SR)
        tl.store(out_ptr + blk[:, None] * 8 + p[None, :], _pack_nibbles(nib, NB, 16), mask=mask[:, None])
        tl.store(s_ptr + blk, scale8.to(tl.uint8, bitcast=True), mask=mask)


@triton.jit
def _cast_nvfp4_2d_kernel(x_ptr, out_ptr, s_ptr, amax_ptr, s_inv_ptr, C, seed, NG: tl.constexpr, SR: tl.constexpr):
    """Rowwise copy with 16x16 NVFP4 blocks (one E4M3 scale per tile; rows and C multiples of 16):
    a program owns 16 rows x NG tiles."""
    s_enc = _fp8_scale(tl.load(amax_ptr), _NVFP4_ENC_MAX, False)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(s_inv_ptr, _recip(s_enc))
    row0 = tl.program_id(0).to(tl.int64) * 16
    g = tl.program_id(1) * NG + tl.arange(0, NG)
    a = tl.arange(0, 16)
    k = tl.arange(0, 16)
    num_g = C // 16
    r3 = (row0 + a)[:, None, None]
    offs = r3 * C + (g[None, :, None] * 16 + k[None, None, :])  # [16, NG, 16]
    mask = g[None, :, None] < num_g
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    block_amax = tl.max(tl.max(_abs_bits(x), axis=2), axis=0).to(tl.float32, bitcast=True)  # [NG]
    scale8, factor = _nvfp4_block_scale(block_amax, s_enc)
    if SR:  # chunks of 8 columns: id (row, chunk of the row)
        noise = _noise16(seed, r3 * (C // 8) + g[None, :, None] * 2 + tl.arange(0, 2)[None, None, :])
    else:
        noise = x
    nib = _e2m1_nibbles(x * factor[None, :, None], noise, SR)
    packed = tl.reshape(_pack_nibbles(tl.reshape(nib, (16 * NG, 16)), 16 * NG, 16), (16, NG, 8))
    p = tl.arange(0, 8)
    tl.store(out_ptr + r3 * (C // 2) + g[None, :, None] * 8 + p[None, None, :], packed, mask=mask)
    tl.store(s_ptr + (row0 // 16) * num_g + g, scale8.to(tl.uint8, bitcast=True), mask=g < num_g)


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


def _launch_cast(x, out, *, scale=None, amax_bits=None, scale_inv=None, fmt_max, from_amax, power_2, record,
                 reverse=False):
    dummy = amax_bits if amax_bits is not None else scale
    _cast_per_tensor_kernel[_per_tensor_grid(x.numel())](
        x, out, scale if scale is not None else dummy, amax_bits if amax_bits is not None else dummy,
        scale_inv if scale_inv is not None else dummy, x.numel(),
        FMT_MAX=fmt_max, SCALE_FROM_AMAX=from_amax, POWER_2=power_2, RECORD_AMAX=record, REVERSE=reverse,
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
                 power_2=power_2, record=False, reverse=True)  # x's tail is in L2 after its amax pass
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


def _launch_tile(x, row, col, m, rows, cols, consts, *, square):
    """_cast_tile_kernel over x [m, cols] (m = B*rows); a copy not asked for gets the other's tensors
    as placeholders (never written)."""
    group = consts["G"]
    ng, sub, warps = _TILE[(group, square)]
    row_data, row_s = row if row[0] is not None else col
    col_data, col_s = col if col[0] is not None else row
    _cast_tile_kernel[(m // group, triton.cdiv(cols // group, ng))](
        x, row_data, row_s, col_data, col_s, rows, cols, NG=ng, SUB=sub, SQUARE=square, num_warps=warps, **consts)


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
    split = columnwise and _ROWCOL_SPLIT[group]
    if rowwise and (split or not columnwise):
        nb, iters, warps = _ROWS_TILE[group]
        nblocks = m * (cols // group)
        _cast_rows_kernel[(triton.cdiv(nblocks, nb * iters),)](
            x, *row, nblocks, NB=nb, ITERS=iters, num_warps=warps, **consts)
    if columnwise:
        consts.update(ROW=rowwise and not split, COL=True)
        _launch_tile(x, row, col, m, rows, cols, consts, square=False)
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
    if (block_rows, block_cols) != (128, 128):
        raise ValueError(f"fused FP8 block casts support 1x128 and 128x128 blocks, got {block_rows}x{block_cols}")
    x = x.contiguous()
    lead, m, rows, cols = _split_shape(x)
    t = block_rows
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
        consts = dict(FMT_MAX=fmt_max, POWER_2=power_2, MX=False, EMAX=0, MARGIN=0, G=t, ROW=rowwise, COL=columnwise)
        _launch_tile(x, row, col, m, rows, cols, consts, square=True)
    return (*row, *col)


@_on_x_device
def cast_mxfp8(x, fp8_dtype, fmt_max: float, emax_elem: int, margin: int, *, rowwise: bool = True,
               columnwise: bool = False):
    """cast.cast_mxfp8 with 1x32 blocks, rowwise and/or columnwise in one pass.

    Returns (row_data, row_codes, col_data, col_codes), codes as uint8 E8M0 bytes."""
    return _one_d_blocks(x, 32, fp8_dtype, fmt_max, power_2=False, mx=True, emax=emax_elem, margin=margin,
                         scale_dtype=torch.uint8, rowwise=rowwise, columnwise=columnwise)


@_on_x_device
def cast_nvfp4(x, block_rows: int, stochastic: bool):
    """The rowwise NVFP4 copy (1x16 or 16x16 blocks, no Hadamard transform): amax pass, then one cast
    pass that derives the tensor scale on the device. Returns (packed uint8 [..., C/2], E4M3 scales,
    float32 0-dim global_scale_inv), equal to ``cast.cast_nvfp4`` with ``nvfp4_global_scale`` of x's
    amax. Stochastic rounding draws its noise in the kernel (Philox, 16 bits per element, seeded from torch's CPU
    generator: ``torch.manual_seed`` makes it reproducible; same distribution as the eager cast,
    another stream)."""
    if block_rows not in (1, 16):
        raise ValueError(f"fused NVFP4 casts support 1x16 and 16x16 blocks, got {block_rows}x16")
    x = x.contiguous()
    lead, m, rows, cols = _split_shape(x)
    if cols % 16 or rows % block_rows:
        raise UnsupportedLayout(f"fused NVFP4 casts need x {tuple(x.shape)} to tile {block_rows}x16")
    dev = x.device
    packed = torch.empty((*lead, rows, cols // 2), dtype=torch.uint8, device=dev)
    scales = torch.empty((*lead, rows // block_rows, cols // 16), dtype=torch.float8_e4m3fn, device=dev)
    s_inv = torch.empty((), dtype=torch.float32, device=dev)
    bits = _amax_bits(x)
    seed = int(torch.randint(0, 2**31 - 1, ())) if stochastic else 0
    if m == 0 or cols == 0:
        s_inv.fill_(1.0)  # nvfp4_global_scale of amax 0 is 1.0
        return packed, scales, s_inv
    if block_rows == 1:
        nb, iters, warps = _NVFP4_ROWS
        nblocks = m * (cols // 16)
        _cast_nvfp4_rows_kernel[(triton.cdiv(nblocks, nb * iters),)](
            x, packed, scales.view(torch.uint8), bits, s_inv, nblocks, seed, NB=nb, ITERS=iters, SR=stochastic,
            num_warps=warps)
    else:
        ng, warps = _NVFP4_2D
        _cast_nvfp4_2d_kernel[(m // 16, triton.cdiv(cols // 16, ng))](
            x, packed, scales.view(torch.uint8), bits, s_inv, cols, seed, NG=ng, SR=stochastic, num_warps=warps)
    return packed, scales, s_inv
