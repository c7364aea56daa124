"""The FP8 scale and byte arithmetic every Triton cast kernel shares (device helpers, no kernels).

One owner for the rules :mod:`.triton_casts` documents (amaxes as int32 bits, the correctly rounded reciprocal, the
saturating cast that keeps NaN, :mod:`.scaling`'s fallbacks and power-of-two rounding, the MX exponent): the casts,
:mod:`.triton_rowcol`, :mod:`.triton_nvfp4`, the SwiGLU kernels and the head loss's gradient call these, so their
bytes agree with each other and with :mod:`.cast`. Imported only with Triton (never at package import).
"""

from __future__ import annotations

import triton
import triton.language as tl

_FP32_MAX = tl.constexpr(3.4028234663852886e38)  # largest finite float32
_F32_INF_BITS = tl.constexpr(0x7F800000)


@triton.jit
def _abs_bits(x):
    """|x| as the int32 bits of its float32 value (sign cleared; NaN sorts above Inf)."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _merge_amax(amax_ptr, amax_bits):
    """max(*amax_ptr, amax_bits) on int32 amax bits, with an atomic only where it raises the value read: for a
    producer merging one value per row into one address (atomics on it serialize, reads do not; a stale read
    costs an extra atomic, never a missed one)."""
    if amax_bits > tl.load(amax_ptr):
        tl.atomic_max(amax_ptr, amax_bits)


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


@triton.jit
def _abs_bits4(x0, x1, x2, x3):
    """Elementwise max of |x_j| bits over the four row sets of a sub-tile ([A, NG, G]; reduced later,
    once: a reduction over rows crosses warps and costs a barrier)."""
    return tl.maximum(tl.maximum(_abs_bits(x0), _abs_bits(x1)), tl.maximum(_abs_bits(x2), _abs_bits(x3)))


@triton.jit
def _fp8_byte(x, mult, FMT_MAX: tl.constexpr, FP8: tl.constexpr):
    """fp8(clamp(x * mult)) as its byte, widened to uint32 for packing."""
    return _saturate(x * mult, FMT_MAX).to(FP8).to(tl.uint8, bitcast=True).to(tl.uint32)
