"""E2M1 (FP4) elements: rounding to the grid, stochastic rounding, packing two per byte.

E2M1 has one sign bit, two exponent bits (bias 1) and one mantissa bit. Its eight magnitudes,
indexed by the 3-bit code ``(exponent << 1) | mantissa``, are::

    code:  0    1    2    3    4    5    6    7
    value: 0   0.5  1.0  1.5  2.0  3.0  4.0  6.0

A 4-bit nibble is ``(sign << 3) | code``. There is no Inf or NaN; values beyond 6 saturate.

Packing (documented contract, same as NVIDIA's NVFP4 and torch.float4_e2m1fn_x2): along the
last dimension, element ``2*i`` goes in the LOW nibble (bits 0-3) and element ``2*i + 1`` in the
HIGH nibble (bits 4-7) of byte ``i``.

Everything is comparisons and integer arithmetic on whole tensors so that it vectorises on any
device and fuses under ``torch.compile``.
"""

from __future__ import annotations

import torch

from .scaling import pow2_from_exponent

__all__ = [
    "E2M1_VALUES",
    "round_to_e2m1_codes",
    "stochastic_round_to_e2m1_codes",
    "e2m1_codes_to_float",
    "pack_e2m1",
    "unpack_e2m1",
]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _sign_bits(x: torch.Tensor) -> torch.Tensor:
    # signbit keeps -0.0 negative, which round-trips through the nibble like the hardware does.
    return torch.signbit(x).to(torch.uint8) << 3


def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest, ties-to-even (even = even code), saturating at 6. Returns uint8 nibbles.

    Midpoints and where their ties go: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0,
    3.5->4.0, 5->4.0. NaN maps to code 0 (E2M1 has no NaN); NVFP4 keeps NaN visible through
    its block scale instead.
    """
    a = x.abs()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return code | _sign_bits(x)


def _floor_codes(a: torch.Tensor) -> torch.Tensor:
    """Code of the largest grid value <= a (a >= 0)."""
    return (
        (a >= 0.5).to(torch.uint8)
        + (a >= 1.0).to(torch.uint8)
        + (a >= 1.5).to(torch.uint8)
        + (a >= 2.0).to(torch.uint8)
        + (a >= 3.0).to(torch.uint8)
        + (a >= 4.0).to(torch.uint8)
        + (a >= 6.0).to(torch.uint8)
    )


def _code_magnitudes(code: torch.Tensor) -> torch.Tensor:
    """Magnitude of 3-bit codes, computed arithmetically (no gather): exponent e, mantissa m."""
    c = code.to(torch.int32)
    e = c >> 1
    m = (c & 1).to(torch.float32)
    normal = (1.0 + 0.5 * m) * pow2_from_exponent(e - 1)  # e>=1: (1 + m/2) * 2**(e-1), exact
    return torch.where(e == 0, 0.5 * m, normal)  # e==0: subnormal m/2


def stochastic_round_to_e2m1_codes(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding: round up with probability equal to the distance from the lower grid
    value divided by the grid gap, so ``E[dequant] == x`` for ``|x| <= 6``. ``noise`` is uniform
    in [0, 1) with x's shape (the caller owns the generator, so results are reproducible)."""
    a = x.abs().clamp(max=6.0)
    lo_code = _floor_codes(a)
    hi_code = (lo_code + 1).clamp(max=7)
    lo = _code_magnitudes(lo_code)
    hi = _code_magnitudes(hi_code)
    gap = hi - lo
    frac = torch.where(gap > 0, (a - lo) / torch.where(gap > 0, gap, 1.0), 0.0)
    code = torch.where(noise < frac, hi_code, lo_code)
    code = torch.where(torch.isnan(x), 0, code).to(torch.uint8)
    return code | _sign_bits(x)


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Nibbles (uint8, low 4 bits used) to float32 values."""
    mag = _code_magnitudes(codes & 7)
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] nibbles -> [..., n] bytes, element 2i in the low nibble, 2i+1 in the high nibble."""
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"packing E2M1 needs an even last dimension, got {codes.shape[-1]}; pad it to a multiple of 2")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: [..., n] bytes -> [..., 2n] nibbles."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
