"""Fused Triton casts for NVFP4's rowwise copy (1x16 blocks, 16x16 for weights), as
:mod:`.triton_casts` does for the FP8 recipes.

Two passes, like FP8 current scaling: the amax pass of :mod:`.triton_casts`, then one cast pass that
derives the tensor scale ``s_enc`` from the amax in device memory (no host sync), writes the E4M3
block scales and the E2M1 nibbles packed two per byte. Round to nearest is **bit-identical** to
``cast.cast_nvfp4`` with ``nvfp4_global_scale`` of x's amax (same float32 operations: the decode
scale multiplies by fp32(1/6), ``s_enc / scale`` is a correctly rounded division done in float64);
stochastic rounding draws its own noise (same distribution as the eager cast, another stream).
The columnwise copy (the wgrad operand, usually Hadamard-transformed) stays on the compiled path.
Imported only through :mod:`.fused`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_casts import UnsupportedLayout, _abs_bits, _amax_bits, _fp8_scale, _on_x_device, _recip, _split_shape

__all__ = ["cast_nvfp4"]

_NVFP4_ROWS = (128, 4, 4)  # 1x16: (blocks per sub-tile, sub-tiles per program, warps)
_NVFP4_2D = (16, 4)  # 16x16: (tiles per program along the columns, warps)


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
