"""Scaling math as pure tensor functions (no state, no Python control flow on tensor values).

Why pure functions: the quantizers add state (amax history, groups) around them, tests pin their
exact values on crafted inputs, and ``torch.compile`` can fuse them into one kernel per format.

Conventions: ``scale`` multiplies high-precision values into the element range
(``q = cast(x * scale)``); ``scale_inv`` multiplies them back (``x ~= q * scale_inv``).

Non-finite or zero amax never produces a zero, infinite or NaN *scale*:
- per-tensor and FP8-block scales fall back to ``fallback`` (1.0, or the previous scale for
  delayed scaling) when amax is 0, Inf or NaN; NaN elements then stay NaN and Inf elements
  saturate to the largest finite element value;
- a scale that would overflow fp32 (amax tiny) is clamped to the largest finite fp32;
- MX: a NaN block gets the E8M0 NaN code (0xFF), so the whole block dequantizes to NaN, as the
  OCP MX spec defines; a zero block gets the smallest exponent (2**-127) and zero elements.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "compute_amax",
    "block_view",
    "block_amax",
    "expand_block_scale",
    "per_tensor_scale",
    "round_down_pow2",
    "mx_shared_exponent",
    "e8m0_codes",
    "e8m0_from_exponent",
    "e8m0_to_float",
    "pow2_from_exponent",
    "nvfp4_global_scale",
    "nvfp4_block_scales",
]

_FP32_MAX = torch.finfo(torch.float32).max
_FP32_TINY = torch.finfo(torch.float32).tiny  # 2**-126, smallest normal


def compute_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a float32 0-dim tensor on x's device; NaN if x holds a NaN; 0 for an empty x."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    # One reduction pass with no |x| temporary (vector_norm(inf) is far slower on CPU);
    # maximum() propagates NaN, and the max of bf16/fp16 values is exact in float32.
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi.abs(), lo.abs()).to(torch.float32)


def block_view(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """[..., R, C] -> [..., R/br, br, C/bc, bc] (a view; caller guarantees divisibility)."""
    *lead, rows, cols = x.shape
    return x.reshape(*lead, rows // block_rows, block_rows, cols // block_cols, block_cols)


def block_amax(xb: torch.Tensor) -> torch.Tensor:
    """Per-block amax of a :func:`block_view`, [..., R/br, C/bc] float32 (NaN propagates)."""
    return xb.abs().amax(dim=(-3, -1)).to(torch.float32)


def expand_block_scale(scale: torch.Tensor) -> torch.Tensor:
    """[..., R/br, C/bc] -> [..., R/br, 1, C/bc, 1], broadcastable against a block view."""
    return scale[..., :, None, :, None]


def round_down_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= scale (positive, finite, normal float32 inputs), via the exponent bits."""
    bits = scale.clamp(min=_FP32_TINY).view(torch.int32) & 0x7F800000
    return bits.view(torch.float32)


def per_tensor_scale(
    amax: torch.Tensor,
    fmt_max: float,
    *,
    margin: int = 0,
    power_2: bool = False,
    fallback: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``scale = fmt_max / amax / 2**margin``, elementwise over any amax shape (per tensor or per block).

    amax 0 / Inf / NaN -> ``fallback`` (default 1.0); overflow -> largest fp32; with ``power_2``
    rounded down to a power of two (so scaled values never exceed fmt_max).
    """
    amax = amax.to(torch.float32)
    scale = (fmt_max / amax) / float(2**margin)
    scale = torch.where(torch.isinf(scale), _FP32_MAX, scale)
    valid = (amax > 0) & torch.isfinite(amax)
    if fallback is None:
        fallback = torch.ones((), dtype=torch.float32, device=amax.device)
    scale = torch.where(valid, scale, fallback.to(torch.float32))
    if power_2:
        scale = round_down_pow2(scale)
    return scale


def mx_shared_exponent(amax: torch.Tensor, emax_elem: int, margin: int = 0) -> torch.Tensor:
    """OCP MX shared exponent ``X = floor(log2(amax)) - emax_elem (+ margin)``, clamped to [-127, 127].

    floor(log2) is read from the float32 exponent bits, so it is exact; amax 0 (and subnormal
    amax) gives the minimum X = -127. int32 result; NaN handled by :func:`e8m0_from_exponent`.
    """
    biased = (amax.to(torch.float32).view(torch.int32) >> 23) & 0xFF
    x = biased - 127 - emax_elem + margin
    x = torch.where(biased == 0, -127, x)
    return x.clamp(-127, 127)


def e8m0_codes(exponent: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes as uint8: biased exponent X + 127, 0xFF (NaN) where the block amax is NaN.

    uint8 rather than float8_e8m0fnu because compiler backends cannot emit that dtype yet;
    callers ``.view(torch.float8_e8m0fnu)`` outside compiled code.
    """
    code = (exponent + 127).to(torch.uint8)
    return torch.where(torch.isnan(amax), 255, code).to(torch.uint8)


def e8m0_from_exponent(exponent: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """:func:`e8m0_codes` viewed as ``torch.float8_e8m0fnu``."""
    return e8m0_codes(exponent, amax).view(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu -> float32 (2**(code - 127); 0xFF -> NaN)."""
    return scale.to(torch.float32)


def pow2_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0 ** exponent`` for integer exponents, clamped to normal floats [-126, 127].

    exp2 of an integer-valued float is exact. (Building the float from exponent bits was exact too,
    but Inductor on CUDA, torch 2.11, emitted an int64 -> float32 bitcast for it and failed to compile.)
    """
    return torch.exp2(exponent.clamp(-126, 127).to(torch.float32))


def nvfp4_global_scale(amax: torch.Tensor, e4m3_max: float = 448.0, e2m1_max: float = 6.0) -> torch.Tensor:
    """NVFP4 tensor-level encode scale ``s_enc = 448 * 6 / amax`` (1.0 for amax 0/Inf/NaN).

    It maps the tensor amax onto the largest block scale (448) times the largest element (6).
    """
    return per_tensor_scale(amax, e4m3_max * e2m1_max)


def nvfp4_block_scales(block_amax_: torch.Tensor, s_enc: torch.Tensor, e2m1_max: float = 6.0):
    """Per-block E4M3 decode scales and the float32 factor that maps elements onto the E2M1 grid.

    ``scale_e4m3 = e4m3(min(block_amax * fp32(1/6) * s_enc, 448))``;
    ``factor = s_enc / scale_e4m3`` (0 where the block scale rounds to 0, so such blocks are zero).
    Dequantize: ``x ~= q * scale_e4m3 / s_enc``. A NaN block amax gives a NaN scale (E4M3 has NaN).
    """
    # times the float32 reciprocal, not "/ e2m1_max": torch's CUDA division by a Python scalar is a
    # multiplication by its reciprocal while the CPU divides, so "/ 6" rounds differently per device
    # (a few blocks in thousands); this product is the same everywhere, and the fused kernel matches it
    decode = (block_amax_ * (1.0 / e2m1_max)) * s_enc
    decode = decode.clamp(max=448.0)  # clamp keeps NaN
    scale_e4m3 = decode.to(torch.float8_e4m3fn)
    scale_f = scale_e4m3.to(torch.float32)
    factor = torch.where(scale_f > 0, s_enc / torch.where(scale_f > 0, scale_f, 1.0), 0.0)
    factor = torch.where(torch.isnan(scale_f), float("nan"), factor)
    return scale_e4m3, factor
