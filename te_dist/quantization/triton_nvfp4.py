"""Fused Triton casts for NVFP4's rowwise copy (1x16 blocks, 16x16 for weights), as
:mod:`.triton_casts` does for the FP8 recipes.

Two passes, like FP8 current scaling: an amax pass (1x16: the one of :mod:`.triton_casts`; 16x16:
_tile_amax_kernel, which also keeps each tile's amax), then one cast pass that derives the tensor
scale ``s_enc`` from the amax in device memory (no host sync), writes the E4M3 block scales and the
E2M1 nibbles packed two per byte. Round to nearest is **bit-identical** to ``cast.cast_nvfp4``
with ``nvfp4_global_scale`` of x's amax (same float32 operations: the decode scale multiplies by
fp32(1/6), ``s_enc / scale`` is a correctly rounded division, no fma contraction); stochastic
rounding draws its own noise (the eager cast's rule to within 2**-16 of a grid gap, another stream).
The columnwise copy (the wgrad operand, usually Hadamard-transformed) stays on the compiled path.
Imported only through :mod:`.fused`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_casts import UnsupportedLayout, _amax_bits, _on_x_device, _split_shape, _zero_bits
from .triton_fp8_math import _abs_bits, _fp8_scale, _recip
from .triton_launch import cdiv, launch

__all__ = ["cast_nvfp4"]

# one block (1x16) or one tile row (16x16) per thread: 32 * warps of them per sub-tile / program
_NVFP4_ROWS = (128, 4, 4)  # 1x16: (blocks per sub-tile, sub-tiles per program, warps)
_NVFP4_2D = (128, 4)  # 16x16: (tiles per program along the columns, warps)
_TILE_AMAX = (128, 4)  # its amax pass: (tiles per program, warps)


# no fma contraction: a multiply feeding an add must round first, as the reference's separate ops do
# (a contracted |x| * factor + M would round the exact product: test_nvfp4_products_that_round_onto_a_tie)
_OPTIONS = dict(enable_fp_fusion=False)

_NVFP4_ENC_MAX = tl.constexpr(2688.0)  # 448 (largest E4M3 block scale) * 6 (largest E2M1 element)


@triton.jit
def _nvfp4_block_scale(block_amax, s_enc):
    """scaling.nvfp4_block_scales: (E4M3 decode scale, float32 factor onto the E2M1 grid)."""
    decode = (block_amax * (1.0 / 6.0)) * s_enc  # fp32(1/6), as the reference (same on CPU and GPU)
    decode = tl.where(decode > 448.0, 448.0, decode)  # keeps NaN
    scale8 = decode.to(tl.float8e4nv)
    scale_f = scale8.to(tl.float32)
    pos = scale_f > 0.0
    factor = tl.where(pos, tl.math.div_rn(s_enc, tl.where(pos, scale_f, 1.0)), 0.0)  # correctly rounded, as torch
    factor = tl.where(scale_f != scale_f, float("nan"), factor)
    return scale8, factor


@triton.jit
def _e2m1_codes_rn(a):
    """E2M1 codes of ``a = |x| * factor`` (>= 0) rounded to nearest even, exactly as
    e2m1.round_to_e2m1_codes, plus the bits of M = 1.5 * 2**23 (0x4B400000: see _nvfp4_words).

    Why this form: the reference's seven comparisons, or rounding a's bits in integer arithmetic,
    keep the integer pipe busy (it issues at half the float rate on Hopper) and made the cast
    compute-bound. Here the rounding is done by float adds: adding M rounds to an integer (to
    nearest even), and the E2M1 grid has step 0.5 below 2, 1 up to 4 and 2 above, so
    ``code = min(rint(2a), rint(a) + 2, rint(a / 2) + 4, 7)``; each term is one fma or add with M,
    and the min is taken on the bits (positive floats order like their bits)."""
    c_half = tl.fma(a, 2.0, 12582912.0).to(tl.int32, bitcast=True)  # rint(2a): exact below 2
    c_one = (a + 12582914.0).to(tl.int32, bitcast=True)  # rint(a) + 2: exact from 2 to 4
    c_two = tl.fma(a, 0.5, 12582916.0).to(tl.int32, bitcast=True)  # rint(a / 2) + 4: exact from 4
    return tl.minimum(tl.minimum(c_half, c_one), tl.minimum(c_two, 0x4B400007))


@triton.jit
def _e2m1_codes_sr(l1, f):
    """E2M1 codes of ``a = |x| * factor`` (>= 0) rounded stochastically, plus the bits of M + 1
    (M as in _e2m1_codes_rn). Takes ``l1 = 2a - 0.5`` (one fma with the doubled factor) and the
    noise ``f = 1 + n``, n = (k + 0.5) / 65536 for k uniform in [0, 65536), from _noise16.

    The code is floor(g(a) + n), clamped at 7, with g(a) = min(2a, a + 2, a / 2 + 4): the grid in
    units of its own gap (step 0.5 below 2, 1 up to 4, 2 above), so the min of the three lines is
    the code coordinate, and ``min_i floor(L_i + n) = floor(min_i L_i + n)``: one noise add for
    all three lines where a rounding per line took two ops each. Each line is kept 0.5 low
    (l1 = 2a - 0.5, a + 1.5, a / 2 + 3.5, the last two from l1 by one fma each) so that adding f
    and rounding by adding M gives rint(g + n + 0.5) = floor(g + n) + 1 (the + 1 is taken off with
    M's bits, no - 1.5 per noise value). Lines are compared on their bits (only l1 can be
    negative, and then it is the min). So a point between two grid neighbours rounds up with
    probability its fraction of the gap to within 2**-16 (the noise grid; the float32 sums round
    at <= 2**-20), the result is always one of the two neighbours, and grid points never move
    (n is never 0 or 1)."""
    l2 = tl.fma(l1, 0.5, 1.75)  # a + 1.5
    l3 = tl.fma(l1, 0.25, 3.625)  # a / 2 + 3.5
    g = tl.minimum(tl.minimum(l1.to(tl.int32, bitcast=True), l2.to(tl.int32, bitcast=True)),
                   l3.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    t = ((g + f) + 12582912.0).to(tl.int32, bitcast=True)
    return tl.minimum(t, 0x4B400008)


@triton.jit
def _nvfp4_words(x, factor, noise, SR: tl.constexpr):
    """``x [..., 8]`` float32 times its block's ``factor`` (``[...]``, broadcastable) -> ``[...]``
    int32 words of eight E2M1 nibbles, element j in bits 4j..4j+3 (e2m1.pack_e2m1's bytes,
    little-endian); the sign comes from x's sign bit (-0.0 keeps it). A NaN factor (a NaN block)
    gives 0: E2M1 has no NaN, the block's NaN scale shows it, and it is what the reference gets on
    the GPU. The nibbles are summed times 16**j rather than shifted and or-ed (multiplies issue on
    the float pipe; the integer pipe is the busy one): the codes carry M's bits (stochastic
    rounding: M + 1's) in every nibble sum, taken off once per word (0x4B400000 * 0x11111111 mod
    2**32 = 0x3F400000; 0x4B400001 * 0x11111111 mod 2**32 = 0x50511111)."""
    f_b = tl.expand_dims(factor, len(factor.shape))
    if SR:
        code = _e2m1_codes_sr(tl.fma(tl.abs(x), 2.0 * f_b, -0.5), noise).to(tl.uint32, bitcast=True)
        carried = 0x50511111
    else:
        code = _e2m1_codes_rn(tl.abs(x) * f_b).to(tl.uint32, bitcast=True)
        carried = 0x3F400000
    nib = code + (x.to(tl.uint32, bitcast=True) >> 31) * 8  # the sign bit
    words = tl.sum(nib * (1 << (tl.arange(0, 8) * 4)).to(tl.uint32), axis=len(x.shape) - 1) - carried
    return tl.where(factor != factor, 0, words.to(tl.int32, bitcast=True))


@triton.jit
def _noise16(seed, chunk):
    """Noise for _e2m1_codes_sr, f = 1 + (k + 0.5) / 65536 with k uniform in [0, 65536), for the 8
    consecutive elements of each ``chunk`` id (``[...]`` ids -> ``[..., 8]`` float32; element
    2w + h from half h of Philox word w of the chunk).

    Why not ``tl.rand`` per element: one Philox call (10 rounds) per element made the stochastic cast
    compute-bound; one call yields 128 bits, enough for 8 elements at 16 bits. The float is built
    from bits: k in the top of the mantissa of 1.0 and a 1 just below it (the + 0.5)."""
    r0, r1, r2, r3 = tl.randint4x(seed, chunk)
    words = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [..., 2, 2]
    halves = tl.join(words & 0xFFFF, words >> 16)  # [..., 2, 2, 2]
    k = tl.reshape(halves, chunk.shape + [8])
    return ((k << 7) | 0x3F800040).to(tl.float32, bitcast=True)


@triton.jit
def _max_nan(a, b):
    """max(a, b), NaN if either is NaN."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _abs_max(x, axis: tl.constexpr):
    """max |x| over ``axis``, NaN if any element is NaN (as scaling.block_amax)."""
    return tl.reduce(tl.abs(x), axis, _max_nan)


@triton.jit
def _cast_nvfp4_rows_kernel(x_ptr, out_ptr, s_ptr, amax_ptr, s_inv_ptr, nblocks, seed, NB: tl.constexpr,
                            ITERS: tl.constexpr, SR: tl.constexpr):
    """Rowwise 1x16 NVFP4 blocks of x streamed as flat [nblocks, 16], loaded as two [NB, 8] halves
    so that one thread owns a whole block (its amax, scale and division once, no shuffles) and
    writes its 8 bytes at once; ``out_ptr`` is the packed copy as int32 words. The tensor scale
    comes from the amax bits in device memory (program 0 writes its inverse). Walks x backwards,
    sub-tiles too, in exactly the reverse order of the amax pass (whose program covers the same
    8192 elements): the lines that pass read last are still in L2 (docs/quantization.md)."""
    s_enc = _fp8_scale(tl.load(amax_ptr), _NVFP4_ENC_MAX, False)
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(s_inv_ptr, _recip(s_enc))
    base = (tl.num_programs(0) - 1 - pid).to(tl.int64) * (NB * ITERS)
    k = tl.arange(0, 8)
    for i in range(ITERS):
        blk = base + (ITERS - 1 - i) * NB + tl.arange(0, NB)
        mask = blk < nblocks
        src = x_ptr + blk[:, None] * 16 + k[None, :]
        x0 = tl.load(src, mask=mask[:, None], other=0.0).to(tl.float32)
        x1 = tl.load(src + 8, mask=mask[:, None], other=0.0).to(tl.float32)
        scale8, factor = _nvfp4_block_scale(_max_nan(_abs_max(x0, 1), _abs_max(x1, 1)), s_enc)
        noise0 = _noise16(seed, blk * 2) if SR else 0
        noise1 = _noise16(seed, blk * 2 + 1) if SR else 0
        words = tl.join(_nvfp4_words(x0, factor, noise0, SR), _nvfp4_words(x1, factor, noise1, SR))  # [NB, 2]
        tl.store(out_ptr + blk[:, None] * 2 + tl.arange(0, 2)[None, :], words, mask=mask[:, None])
        tl.store(s_ptr + blk, scale8.to(tl.uint8, bitcast=True), mask=mask)


@triton.jit
def _tile_program(p, C, NG: tl.constexpr):
    """Program p of a 16x16-block kernel -> (its row of tiles, its NG tile columns): column groups
    first, so consecutive programs read consecutive memory."""
    groups = tl.cdiv(C // 16, NG)
    return (p // groups).to(tl.int64), (p % groups) * NG + tl.arange(0, NG)


def _amax_tile(dtype: torch.dtype):
    """(tiles per program, warps) of the 16x16 amax pass for x of ``dtype``: float32 holds twice the
    registers of bf16 per tile, so twice the warps (with four, one register spilled)."""
    ng, warps = _TILE_AMAX
    return ng, (2 * warps if dtype == torch.float32 else warps)


@triton.jit
def _tile_amax_kernel(x_ptr, tiles_ptr, amax_ptr, C, NG: tl.constexpr):
    """The amax pass of 16x16 blocks: each tile's amax (float32, [rows / 16, C / 16]) and the tensor
    amax bits (an atomic max, as triton_casts._amax_kernel). Why: with the tile amaxes known, the
    cast pass streams x once; finding them there meant reading every tile twice. A program owns
    16 rows x NG tiles and reads them row by row (a running max in registers); consecutive programs
    take consecutive column groups (x is read in memory order, like the 1x16 amax pass).

    Rows go bottom to top: the cast pass walks the programs backwards and each tile top to bottom,
    so it reads x in exactly the reverse order of this pass and its first reads find the lines this
    pass read last, still in L2 (docs/quantization.md, "Read order across the two passes")."""
    row_tile, g = _tile_program(tl.program_id(0), C, NG)
    row0 = row_tile * 16
    num_g = C // 16
    mask = (g < num_g)[:, None]
    src = x_ptr + (row0 + 15) * C + g[:, None] * 16 + tl.arange(0, 16)[None, :]  # [NG, 16]: row 15 of each tile
    acc = tl.abs(tl.load(src, mask=mask, other=0.0).to(tl.float32))
    for r in tl.static_range(1, 16):  # unrolled: all 16 loads in flight (a loop is slower)
        acc = _max_nan(acc, tl.abs(tl.load(src - r * C, mask=mask, other=0.0)))
    tile = _abs_max(acc, 1)  # [NG]
    tl.store(tiles_ptr + row_tile * num_g + g, tile, mask=g < num_g)
    tl.atomic_max(amax_ptr, tl.max(_abs_bits(tile), axis=0), sem="relaxed")


@triton.jit
def _cast_nvfp4_2d_kernel(x_ptr, out_ptr, s_ptr, tiles_ptr, amax_ptr, s_inv_ptr, C, seed, NG: tl.constexpr,
                          SR: tl.constexpr):
    """Rowwise copy with 16x16 NVFP4 blocks (one E4M3 scale per tile; rows and C multiples of 16),
    the tile amaxes from _tile_amax_kernel: a program owns 16 rows x NG tiles, one thread per tile,
    and casts them row by row as two [NG, 8] halves. ``out_ptr`` is the packed copy as int32 words.
    Walks the row tiles backwards, like the 1x16 cast after its amax pass."""
    s_enc = _fp8_scale(tl.load(amax_ptr), _NVFP4_ENC_MAX, False)
    if tl.program_id(0) == 0:
        tl.store(s_inv_ptr, _recip(s_enc))
    row_tile, g = _tile_program(tl.num_programs(0) - 1 - tl.program_id(0), C, NG)  # backwards
    row0 = row_tile * 16
    num_g = C // 16
    mask = g < num_g
    tile = row_tile * num_g + g
    scale8, factor = _nvfp4_block_scale(tl.load(tiles_ptr + tile, mask=mask, other=0.0), s_enc)
    src = x_ptr + row0 * C + g[:, None] * 16 + tl.arange(0, 8)[None, :]  # [NG, 8]: row 0, first halves
    dst = out_ptr + row0 * (C // 8) + g[:, None] * 2 + tl.arange(0, 2)[None, :]  # [NG, 2]
    for r in range(16):
        x0 = tl.load(src + r * C, mask=mask[:, None], other=0.0).to(tl.float32)
        x1 = tl.load(src + r * C + 8, mask=mask[:, None], other=0.0).to(tl.float32)
        word = (row0 + r) * (C // 8) + g * 2  # noise chunk ids: the words' indices
        noise0 = _noise16(seed, word) if SR else 0
        noise1 = _noise16(seed, word + 1) if SR else 0
        words = tl.join(_nvfp4_words(x0, factor, noise0, SR), _nvfp4_words(x1, factor, noise1, SR))
        tl.store(dst + r * (C // 8), words, mask=mask[:, None])
    tl.store(s_ptr + tile, scale8.to(tl.uint8, bitcast=True), mask=mask)


@_on_x_device
def cast_nvfp4(x, block_rows: int, stochastic: bool):
    """The rowwise NVFP4 copy (1x16 or 16x16 blocks, no Hadamard transform): an amax pass (for 16x16
    blocks it also keeps each tile's amax), then one cast pass that derives the tensor scale on the
    device. Returns (packed uint8 [..., C/2], E4M3 scales, float32 0-dim global_scale_inv), equal to
    ``cast.cast_nvfp4`` with ``nvfp4_global_scale`` of x's amax. Stochastic rounding draws its noise
    in the kernel (Philox, 16 bits per element, seeded from torch's CPU generator: ``torch.manual_seed``
    makes it reproducible; the eager cast's rule to within 2**-16 of a grid gap, another stream)."""
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
    seed = int(torch.randint(0, 2**31 - 1, ())) if stochastic else 0
    if m == 0 or cols == 0:
        s_inv.fill_(1.0)  # nvfp4_global_scale of amax 0 is 1.0
        return packed, scales, s_inv
    if block_rows == 1:
        bits = _amax_bits(x)
        nb, iters, warps = _NVFP4_ROWS
        nblocks = m * (cols // 16)
        launch(_cast_nvfp4_rows_kernel, (cdiv(nblocks, nb * iters),),
            x, packed.view(torch.int32), scales.view(torch.uint8), bits, s_inv, nblocks, seed, NB=nb, ITERS=iters,
            SR=stochastic, num_warps=warps, **_OPTIONS)
    else:
        bits, tiles = _zero_bits(dev), torch.empty((m // 16, cols // 16), dtype=torch.float32, device=dev)
        ng, warps = _amax_tile(x.dtype)
        launch(_tile_amax_kernel, ((m // 16) * cdiv(cols // 16, ng),), x, tiles, bits, cols, NG=ng,
               num_warps=warps)
        ng, warps = _NVFP4_2D
        launch(_cast_nvfp4_2d_kernel, ((m // 16) * cdiv(cols // 16, ng),),
            x, packed.view(torch.int32), scales.view(torch.uint8), tiles, bits, s_inv, cols, seed, NG=ng,
            SR=stochastic, num_warps=warps, **_OPTIONS)
    return packed, scales, s_inv
