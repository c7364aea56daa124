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

NVFP4's kernels live in :mod:`.triton_nvfp4`, the per-tensor casts that also write the transposed
copy in :mod:`.triton_rowcol`, the scale and byte arithmetic they all share (the rules above) in
:mod:`.triton_fp8_math`. Imported only through
:mod:`.fused` (never at package import: CI has no Triton). Shapes: x
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

from . import cuda_blocks
from .triton_fp8_math import (_abs_bits, _abs_bits4, _block_scale, _fp8_byte, _fp8_scale, _inf_to_max, _recip,
                              _saturate)
from .triton_launch import cdiv, launch, next_power_of_2

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


# --------------------------------------------------------------------------- tiles (heuristics)
# Picked by a tile sweep (docs/quantization.md "Tiles"). Bandwidth wants many bytes in flight per SM and few registers per thread: every kernel works on
# sub-tiles of ~16 elements per thread (no spills) and loops over several of them, so one program
# still moves >= 8-16 KB of bf16 input and issues one amax atomic.
_PT_BLOCK, _PT_ITERS, _PT_WARPS = 2048, 4, 4  # per-tensor: 8192 elements per program
_PT_TILE = (64, 128, 4)  # FP8 byte transpose: rows, columns per program, warps
# rowwise-only 1xG blocks are consecutive runs of G elements in memory: the kernel streams x as a flat
# [blocks, G] array. group -> (blocks per sub-tile, sub-tiles per program, warps): 2048 elements per sub-tile
_ROWS_TILE = {128: (16, 4, 4), 32: (64, 4, 4)}
# G-row tiles (_cast_tile_kernel): a program owns G rows x NG*G columns in sub-tiles of SUB rows;
# (group, square) -> (NG, SUB, warps). Rows+columns of 1xG blocks, and 128x128 blocks (either copy).
_TILE = {(128, False): (1, 64, 4), (32, False): (8, 32, 4), (128, True): (1, 64, 4)}
# group -> True: a row+col cast runs the rowwise kernel, then the tile kernel for the columnwise copy
# only (x read twice, fewer reductions per tile); False: one tile kernel writes both copies
_ROWCOL_SPLIT = {128: False, 32: False}


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
def _roll_history(amax_bits, hist_ptr, scale_ptr, new_hist_ptr, new_scale_ptr, new_scale_inv_ptr, hist_len,
                  margin_mul, FMT_MAX: tl.constexpr, ALGO_MAX: tl.constexpr, BLOCK: tl.constexpr,
                  ITERS: tl.constexpr):
    """cast.delayed_scale_update from x's amax bits into NEW tensors (the old scale_inv stays valid
    for the tensor the cast returns). ``ITERS`` = cdiv(hist_len, BLOCK), fixed per recipe: a loop over
    a runtime bound breaks Triton's interpreter, whose runtime ints are arrays."""
    best = amax_bits
    for i in range(ITERS):
        offs = i * BLOCK + tl.arange(0, BLOCK)
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


@triton.jit
def _cast_per_tensor_kernel(x_ptr, out_ptr, scale_ptr, amax_ptr, scale_inv_ptr, n, hist_ptr, new_hist_ptr,
                            new_scale_ptr, new_scale_inv_ptr, hist_len, margin_mul,
                            FMT_MAX: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr, POWER_2: tl.constexpr,
                            RECORD_AMAX: tl.constexpr, REVERSE: tl.constexpr, UPDATE: tl.constexpr,
                            ALGO_MAX: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                            HIST_BLOCK: tl.constexpr, HIST_ITERS: tl.constexpr):
    """out = fp8(clamp(x * scale)); the scale is read from ``scale_ptr`` or derived from the amax
    bits at ``amax_ptr`` (program 0 then writes scale_inv); RECORD_AMAX accumulates amax(x) there.

    UPDATE (delayed scaling, with RECORD_AMAX): the program that finishes last (a counter at
    ``amax_ptr + 1``, zeroed with the amax) rolls amax(x) into the history and writes the next scale
    (``_roll_history``), so a cast and its update are one launch. Each program's amax goes out before
    its counter increment (one thread issues both; acq_rel orders them), and the last program reads the
    amax with an atomic, after every other program's increment.

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
        if UPDATE:
            if tl.atomic_add(amax_ptr + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
                _roll_history(tl.atomic_add(amax_ptr, 0, sem="acquire"), hist_ptr, scale_ptr, new_hist_ptr,
                              new_scale_ptr, new_scale_inv_ptr, hist_len, margin_mul, FMT_MAX, ALGO_MAX, HIST_BLOCK,
                              HIST_ITERS)


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
def _load_rows(x_ptr, idx_ptr, r, C, c3, mask, GATHER: tl.constexpr):
    """x[r, c3] as float32, r: [A] row indices, c3: [1, NG, G] column indices -> [A, NG, G]. GATHER: row
    r is x's row idx[r] instead, and a negative idx reads zeros (a padding row)."""
    if GATHER:
        src = tl.load(idx_ptr + r)
        return tl.load(x_ptr + src[:, None, None] * C + c3, mask=mask & (src >= 0)[:, None, None],
                       other=0.0).to(tl.float32)
    return tl.load(x_ptr + r[:, None, None] * C + c3, mask=mask, other=0.0).to(tl.float32)


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
def _col_scale_offsets(b, c2, rl0, R, C, G: tl.constexpr, COL_T: tl.constexpr):
    """Where the 1xG column scales of block row rl0 / G of matrix b go: [B, C, R/G], or with COL_T (one
    matrix) [R/G + 1, C] M-major."""
    if COL_T:
        return (rl0 // G) * C + c2
    else:
        return b * C * (R // G) + c2 * (R // G) + rl0 // G


@triton.jit
def _cast_tile_kernel(x_ptr, idx_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, R, C,
                      FMT_MAX: tl.constexpr, POWER_2: tl.constexpr, MX: tl.constexpr, EMAX: tl.constexpr,
                      MARGIN: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, SUB: tl.constexpr,
                      ROW: tl.constexpr, COL: tl.constexpr, SQUARE: tl.constexpr, COL_T: tl.constexpr,
                      GATHER: tl.constexpr):
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
    shared memory hits bank conflicts (docs/quantization.md), and converting a transposed float32 tile
    to FP8 mis-places elements with Triton 3.6.

    COL_T (1xG blocks of one matrix): the columnwise scales go out M-major, [R/G + 1, C] with a zero
    last row (``_col_scale_offsets``), the layout the FP8 wgrad kernel reads, so no per-GEMM re-layout.

    GATHER (one matrix): the R rows cast are rows ``idx[r]`` of x (negative: a zero row), read through
    the index: the gathered rows are never written in bf16 (``cast_fp8_blocks(gather=...)``)."""
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
            acc3 = tl.maximum(acc3, _abs_bits4(_load_rows(x_ptr, idx_ptr, r, C, c3, mask, GATHER),
                                               _load_rows(x_ptr, idx_ptr, r + 1, C, c3, mask, GATHER),
                                               _load_rows(x_ptr, idx_ptr, r + 2, C, c3, mask, GATHER),
                                               _load_rows(x_ptr, idx_ptr, r + 3, C, c3, mask, GATHER)))
        acc = tl.max(acc3, axis=0)  # [NG, G]
        if SQUARE:
            sq_mult, sq_stored = _block_scale(tl.max(acc, axis=1), FMT_MAX, POWER_2, MX, EMAX, MARGIN)  # [NG]
            # the columnwise copy takes the [NG, G] scale path of 1xG blocks: with a [NG] scale
            # broadcast into the packed-word cast, Triton 3.6 produces wrong bytes on the GPU
            col_mult = tl.zeros((NG, G), dtype=tl.float32) + sq_mult[:, None]
            if ROW:
                tl.store(row_s_ptr + (row0 // G) * num_g + g, sq_stored, mask=g < num_g)
            if COL:
                tl.store(col_s_ptr + b * num_g * (R // G) + g * (R // G) + rl0 // G, sq_stored, mask=g < num_g)
        else:
            col_mult, col_stored = _block_scale(acc, FMT_MAX, POWER_2, MX, EMAX, MARGIN)
            tl.store(col_s_ptr + _col_scale_offsets(b, c2, rl0, R, C, G, COL_T), col_stored, mask=g[:, None] < num_g)
    if COL_T:
        if rl0 + G == R:  # the last block row's programs also write the zero row after it
            tl.store(col_s_ptr + (R // G) * C + c2, tl.zeros((NG, G), dtype=tl.float32), mask=g[:, None] < num_g)
    col_w = col_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    for i in range(G // SUB):
        r = row0 + i * SUB + a4
        x0 = _load_rows(x_ptr, idx_ptr, r, C, c3, mask, GATHER)
        x1 = _load_rows(x_ptr, idx_ptr, r + 1, C, c3, mask, GATHER)
        x2 = _load_rows(x_ptr, idx_ptr, r + 2, C, c3, mask, GATHER)
        x3 = _load_rows(x_ptr, idx_ptr, r + 3, C, c3, mask, GATHER)
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
                tl.store(col_s_ptr + _col_scale_offsets(b, c2, rl0, R, C, G, COL_T), col_stored,
                         mask=g[:, None] < num_g)
            mult = col_mult[None, :, :]
            w = (_fp8_byte(x0, mult, FMT_MAX, FP8) | (_fp8_byte(x1, mult, FMT_MAX, FP8) << 8)
                 | (_fp8_byte(x2, mult, FMT_MAX, FP8) << 16) | (_fp8_byte(x3, mult, FMT_MAX, FP8) << 24))
            wt = tl.permute(w, (1, 2, 0))  # [NG, G (column), SUB/4 (row word)]
            # word index from an arange (not from r // 4), so Triton sees the run and vectorizes the store
            words = b * (C * (R // 4)) + c2[:, :, None] * (R // 4) + ((rl0 + i * SUB) // 4 + tl.arange(0, A))[None, None, :]
            tl.store(col_w + words, wt, mask=g[:, None, None] < num_g)


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


def _scalar_f32(t: torch.Tensor) -> torch.Tensor:
    """A float32 scalar as the kernels read it (one value at a pointer): no copy when it is one already
    (each avoided ``to``/``reshape`` is host time on every cast)."""
    return t if t.dtype == torch.float32 and t.numel() == 1 else t.to(torch.float32).reshape(1).contiguous()


def _per_tensor_grid(n: int):
    return (max(1, cdiv(n, _PT_BLOCK * _PT_ITERS)),)


def _launch_cast(x, out, *, scale=None, amax_bits=None, scale_inv=None, fmt_max, from_amax, power_2, record,
                 reverse=False, update=None):
    """``update``: (history, new_history, new_scale, new_scale_inv, margin, algo) of a delayed-scaling
    cast whose last program rolls the history (``amax_bits`` then holds a zeroed counter after the amax)."""
    dummy = amax_bits if amax_bits is not None else scale
    n = x.numel()
    if update is None:
        hist = (dummy, dummy, dummy, dummy, 0, 1.0)
        algo_max, hist_block, hist_len = False, 16, 0
    else:
        history, new_history, new_scale, new_scale_inv, margin, algo = update
        hist_len = history.numel()
        hist = (history, new_history, new_scale, new_scale_inv, hist_len, math.ldexp(1.0, -margin))
        algo_max, hist_block = algo == "max", min(1024, next_power_of_2(max(hist_len, 1)))
    launch(_cast_per_tensor_kernel, _per_tensor_grid(n),
           x, out, scale if scale is not None else dummy, amax_bits if amax_bits is not None else dummy,
           scale_inv if scale_inv is not None else dummy, n, *hist,
           FMT_MAX=fmt_max, SCALE_FROM_AMAX=from_amax, POWER_2=power_2, RECORD_AMAX=record, REVERSE=reverse,
           UPDATE=update is not None, ALGO_MAX=algo_max, BLOCK=_PT_BLOCK, ITERS=_PT_ITERS, HIST_BLOCK=hist_block,
           HIST_ITERS=cdiv(hist_len, hist_block), num_warps=_PT_WARPS)


def _amax_bits(x: torch.Tensor) -> torch.Tensor:
    bits = _zero_bits(x.device)
    n = x.numel()
    if n:
        launch(_amax_kernel, _per_tensor_grid(n), x, bits, n, BLOCK=_PT_BLOCK, ITERS=_PT_ITERS, num_warps=_PT_WARPS)
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
    return _cast_from_amax_bits(x.contiguous(), _scalar_f32(amax).view(torch.int32), fp8_dtype, fmt_max, power_2)


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
    _launch_cast(x, data, scale=_scalar_f32(scale), amax_bits=bits, fmt_max=fmt_max, from_amax=False, power_2=False,
                 record=True)
    return data, bits.view(torch.float32).reshape(())


def _delayed_outputs(history, algo: str, device):
    """(history as float32 contiguous, NEW history, scale, scale_inv to write) of a fused delayed step."""
    if algo not in ("max", "most_recent"):
        raise ValueError(f"fused delayed scaling supports amax_compute_algo 'max' or 'most_recent', got {algo!r}")
    if history.dtype != torch.float32 or not history.is_contiguous():
        history = history.to(torch.float32).contiguous()
    new_scale, new_scale_inv = (torch.empty((), dtype=torch.float32, device=device) for _ in range(2))
    return history, torch.empty(history.numel(), dtype=torch.float32, device=device), new_scale, new_scale_inv


def _delayed_step(x, scale, history, fp8_dtype, fmt_max: float, margin: int, algo: str):
    """One launch: the cast with ``scale``, amax(x), and (its last program) the history roll into NEW
    (history, scale, scale_inv)."""
    x = x.contiguous()
    history, new_history, new_scale, new_scale_inv = _delayed_outputs(history, algo, x.device)
    bits = torch.zeros(2, dtype=torch.int32, device=x.device)  # amax bits, programs finished
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    _launch_cast(x, data, scale=_scalar_f32(scale), amax_bits=bits, fmt_max=fmt_max, from_amax=False, power_2=False,
                 record=True, update=(history, new_history, new_scale, new_scale_inv, margin, algo))
    return data, new_history, new_scale, new_scale_inv


@_on_x_device
def delayed_scaling_step(x, scale, history, fp8_dtype, fmt_max: float, margin: int, algo: str):
    """cast.delayed_scaling_step: one cast+amax pass, then one tiny update kernel.
    Returns NEW (data, history, scale, scale_inv); the inputs are not modified."""
    return _delayed_step(x, scale, history, fp8_dtype, fmt_max, margin, algo)


def _split_shape(x: torch.Tensor):
    *lead, rows, cols = x.shape
    return tuple(lead), math.prod(lead) * rows, rows, cols


def _launch_tile(x, row, col, m, rows, cols, consts, *, square, gather=None, tile=None):
    """_cast_tile_kernel over x [m, cols] (m = B*rows; with ``gather``, the rows ``gather`` of a 2-D x,
    m = rows = its length); a copy not asked for gets the other's tensors as placeholders (never written).

    A float32 columnwise-only cast writes a rowwise copy to scratch anyway: with Triton 3.6 the kernel
    variant without the rowwise copy multiplies float32 data by wrong block scales on the GPU (the
    stored scales are right; docs/quantization.md has the runs), and the variant with it is exact
    (test_float8_blocks)."""
    group = consts["G"]
    if x.dtype == torch.float32 and consts["COL"] and not consts["ROW"]:
        lead = x.shape[:-2]
        scale_shape = (*lead, rows // group, cols // group) if square else (*lead, rows, cols // group)
        row = (torch.empty((*lead, rows, cols), dtype=col[0].dtype, device=x.device),
               torch.empty(scale_shape, dtype=col[1].dtype, device=x.device))
        consts = {**consts, "ROW": True}
    ng, sub, warps = tile or _TILE[(group, square)]
    row_data, row_s = row if row[0] is not None else col
    col_data, col_s = col if col[0] is not None else row
    launch(_cast_tile_kernel, (m // group, cdiv(cols // group, ng)),
        x, x if gather is None else gather, row_data, row_s, col_data, col_s, rows, cols, NG=ng, SUB=sub,
        SQUARE=square, GATHER=gather is not None, num_warps=warps, **consts)


def _one_d_blocks(x, group, fp8_dtype, fmt_max, *, power_2, mx, emax, margin, scale_dtype, rowwise, columnwise,
                  col_scales_t=False, gather=None):
    """Shared driver of the 1xG casts (Float8 1x128, MXFP8 1x32). ``col_scales_t`` (2-D x): the
    columnwise scales come back M-major, [rows/G + 1, cols] with a zero last row (the wgrad layout).
    ``gather`` (2-D x, the columnwise copy asked for): cast rows ``gather`` of x instead (int64 [rows],
    negative for a zero row), read through the index by the tile kernel."""
    if columnwise and not mx and group == cuda_blocks.BLOCK and cuda_blocks.blocks_enabled_for(x, fp8_dtype, gather):
        # both copies from one read in CUDA, 1.01-1.20x the tile kernel here (te_dist.settings.cuda_block_cast)
        return cuda_blocks.cast_blocks(x, fp8_dtype, fmt_max, power_2, rowwise=rowwise, col_scales_t=col_scales_t,
                                       gather=gather)
    x = x.contiguous()
    lead, m, rows, cols = _split_shape(x)
    if gather is not None:
        if x.dim() != 2 or not columnwise or _ROWCOL_SPLIT[group]:
            raise UnsupportedLayout("a gathered 1xG cast runs in the tile kernel: a 2-D x, the columnwise copy asked for")
        m = rows = gather.shape[0]
    if cols % group or (columnwise and rows % group):
        # e.g. a columnwise-only copy of x[32, 16] with 1x32 blocks: valid, but these kernels tile x's
        # columns in whole blocks; the compiled cast handles it.
        raise UnsupportedLayout(f"fused 1x{group} casts need both dims of x {tuple(x.shape)} to tile {group}")
    col_scales_t = col_scales_t and columnwise
    if col_scales_t and lead:
        raise ValueError(f"M-major columnwise scales are written for a 2-D x, received shape {tuple(x.shape)}")
    dev = x.device
    row = col = (None, None)
    if rowwise:
        row = (torch.empty((*lead, rows, cols), dtype=fp8_dtype, device=dev),
               torch.empty((*lead, rows, cols // group), dtype=scale_dtype, device=dev))
    if columnwise:
        col_scale_shape = (rows // group + 1, cols) if col_scales_t else (*lead, cols, rows // group)
        col = (torch.empty((*lead, cols, rows), dtype=fp8_dtype, device=dev),
               torch.empty(col_scale_shape, dtype=scale_dtype, device=dev))
    if m == 0 or cols == 0:
        if col_scales_t:
            col[1].zero_()
        return (*row, *col)
    consts = dict(FMT_MAX=fmt_max, POWER_2=power_2, MX=mx, EMAX=emax, MARGIN=margin, G=group)
    split = columnwise and _ROWCOL_SPLIT[group]
    if rowwise and (split or not columnwise):
        nb, iters, warps = _ROWS_TILE[group]
        nblocks = m * (cols // group)
        launch(_cast_rows_kernel, (cdiv(nblocks, nb * iters),),
            x, *row, nblocks, NB=nb, ITERS=iters, num_warps=warps, **consts)
    if columnwise:
        consts.update(ROW=rowwise and not split, COL=True, COL_T=col_scales_t)
        _launch_tile(x, row, col, m, rows, cols, consts, square=False, gather=gather)
    return (*row, *col)


@_on_x_device
def cast_fp8_blocks(x, block_rows: int, block_cols: int, fp8_dtype, fmt_max: float, power_2: bool, *,
                    rowwise: bool = True, columnwise: bool = False, col_scales_t: bool = False, gather=None,
                    tile=None):
    """cast.cast_fp8_blocks for 1x128 and 128x128 blocks, rowwise and/or columnwise in one pass.

    Returns (row_data, row_scale_inv, col_data, col_scale_inv) (None for a copy not asked for);
    the columnwise copy equals ``cast.cast_fp8_blocks(x.transpose(-1, -2), ...)``. With
    ``col_scales_t`` (1x128 blocks, 2-D x) col_scale_inv is M-major: [rows/128 + 1, cols], its
    first rows/128 rows that copy's scales transposed, the last row zeros. ``gather`` (1x128 blocks,
    2-D x, columnwise): the copies of rows ``gather`` of x (int64, negative: a zero row), as if that
    gathered matrix were x. ``tile``: a 128x128 cast's (NG, SUB, warps) instead of ``_TILE``'s (a sweep)."""
    if (block_rows, block_cols) == (1, 128):
        return _one_d_blocks(x, 128, fp8_dtype, fmt_max, power_2=power_2, mx=False, emax=0, margin=0,
                             scale_dtype=torch.float32, rowwise=rowwise, columnwise=columnwise,
                             col_scales_t=col_scales_t, gather=gather)
    if gather is not None:
        raise UnsupportedLayout(f"gathered casts are written for 1x128 blocks, asked for {block_rows}x{block_cols}")
    if col_scales_t:
        raise ValueError(f"M-major columnwise scales are written for 1x128 blocks, asked for {block_rows}x{block_cols}")
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
        consts = dict(FMT_MAX=fmt_max, POWER_2=power_2, MX=False, EMAX=0, MARGIN=0, G=t, ROW=rowwise, COL=columnwise,
                      COL_T=False)
        _launch_tile(x, row, col, m, rows, cols, consts, square=True, tile=tile)
    return (*row, *col)


@_on_x_device
def cast_mxfp8(x, fp8_dtype, fmt_max: float, emax_elem: int, margin: int, *, rowwise: bool = True,
               columnwise: bool = False):
    """cast.cast_mxfp8 with 1x32 blocks, rowwise and/or columnwise in one pass.

    Returns (row_data, row_codes, col_data, col_codes), codes as uint8 E8M0 bytes."""
    return _one_d_blocks(x, 32, fp8_dtype, fmt_max, power_2=False, mx=True, emax=emax_elem, margin=margin,
                         scale_dtype=torch.uint8, rowwise=rowwise, columnwise=columnwise)

