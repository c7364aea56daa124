"""One quantize function per element format, written as pure whole-tensor math.

Why separate from the quantizers: these are the "kernels" — no validation, no state, shapes
already checked — so on CUDA they run through ``torch.compile`` (see :mod:`.compile`), where each
becomes one fused pass over the input, and on CPU they run eagerly. Each takes a float tensor
``x[..., R, C]`` whose last dimension (and, for 2D blocks, the one before) is a multiple of the
block size, and quantizes along the last dimension.
"""

from __future__ import annotations

from typing import Optional

import torch

from .e2m1 import pack_e2m1, round_to_e2m1_codes, stochastic_round_to_e2m1_codes
from .scaling import (
    block_amax,
    compute_amax,
    block_view,
    e8m0_codes,
    expand_block_scale,
    mx_shared_exponent,
    nvfp4_block_scales,
    per_tensor_scale,
    pow2_from_exponent,
)

__all__ = [
    "cast_fp8_per_tensor",
    "current_scaling_quantize",
    "delayed_scale_update",
    "delayed_scaling_step",
    "cast_fp8_blocks",
    "cast_mxfp8",
    "cast_nvfp4",
    "dequantize_blocks",
]


def _dense_float(x: torch.Tensor) -> torch.Tensor:
    """float32, row-major: a columnwise copy arrives as a transposed view, and blocking a
    non-contiguous tensor is many times slower in eager mode (compiled, this fuses away)."""
    return x.to(dtype=torch.float32, memory_format=torch.contiguous_format)


def cast_fp8_per_tensor(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, fmt_max: float) -> torch.Tensor:
    """FP8 data = saturate(x * scale) rounded to nearest even; NaN stays NaN."""
    return (x.to(torch.float32) * scale).clamp(-fmt_max, fmt_max).to(fp8_dtype)


def current_scaling_quantize(x: torch.Tensor, fp8_dtype: torch.dtype, fmt_max: float, power_2: bool):
    """amax -> scale -> cast in one function (two kernels once compiled). Returns (data, scale_inv)."""
    scale = per_tensor_scale(compute_amax(x), fmt_max, power_2=power_2)
    return cast_fp8_per_tensor(x, scale, fp8_dtype, fmt_max), 1.0 / scale


def delayed_scale_update(amax, history, scale, fmt_max: float, margin: int, algo: str):
    """Roll amax into the history (index 0 = newest) and derive the next scale ("max" / "most_recent");
    a zero or non-finite history amax keeps ``scale``. Returns (history, scale, scale_inv)."""
    history = torch.cat((amax.reshape(1).to(history.dtype), history[:-1]))
    chosen = history.amax() if algo == "max" else history[0]
    new_scale = per_tensor_scale(chosen, fmt_max, margin=margin, fallback=scale)
    return history, new_scale, 1.0 / new_scale


def delayed_scaling_step(x, scale, history, fp8_dtype: torch.dtype, fmt_max: float, margin: int, algo: str):
    """One DelayedScaling call without amax reduction: cast with ``scale``, then update from x's amax.
    Returns (data, history, scale, scale_inv)."""
    data = cast_fp8_per_tensor(x, scale, fp8_dtype, fmt_max)
    history, new_scale, new_scale_inv = delayed_scale_update(compute_amax(x), history, scale, fmt_max, margin, algo)
    return data, history, new_scale, new_scale_inv


def cast_fp8_blocks(
    x: torch.Tensor, block_rows: int, block_cols: int, fp8_dtype: torch.dtype, fmt_max: float, power_2: bool
):
    """FP8 with one float32 scale per (block_rows x block_cols) block. Returns (data, scale_inv)."""
    xb = block_view(_dense_float(x), block_rows, block_cols)
    scale = per_tensor_scale(block_amax(xb), fmt_max, power_2=power_2)
    data = (xb * expand_block_scale(scale)).clamp(-fmt_max, fmt_max).to(fp8_dtype)
    return data.reshape(x.shape), 1.0 / scale


def cast_mxfp8(x: torch.Tensor, block: int, fp8_dtype: torch.dtype, fmt_max: float, emax_elem: int, margin: int):
    """OCP MX: 1 x block groups share ``2**X`` (E8M0), elements are ``x / 2**X`` in FP8.

    Returns (data, scale codes as uint8; view them as ``torch.float8_e8m0fnu``)."""
    xb = block_view(_dense_float(x), 1, block)
    amax = block_amax(xb)
    exponent = mx_shared_exponent(amax, emax_elem, margin)
    multiplier = pow2_from_exponent(-exponent)  # exact 2**-X
    data = (xb * expand_block_scale(multiplier)).clamp(-fmt_max, fmt_max).to(fp8_dtype)
    return data.reshape(x.shape), e8m0_codes(exponent, amax)


def cast_nvfp4(
    x: torch.Tensor,
    block_rows: int,
    block_cols: int,
    s_enc: torch.Tensor,
    noise: Optional[torch.Tensor] = None,
    stochastic: bool = False,
):
    """NVFP4: E4M3 scale per block (1x16 or 16x16), E2M1 elements packed two per byte.

    ``stochastic`` switches to stochastic rounding with uniform [0, 1) ``noise`` of x's shape; without
    ``noise`` it is drawn here from the global RNG, so a compiled version generates it inside the
    fused kernel instead of reading a float32 noise tensor. Returns (packed, scale_e4m3).
    """
    xb = block_view(_dense_float(x), block_rows, block_cols)
    scale_e4m3, factor = nvfp4_block_scales(block_amax(xb), s_enc)
    scaled = (xb * expand_block_scale(factor)).reshape(x.shape)
    if not stochastic:
        codes = round_to_e2m1_codes(scaled)
    else:
        if noise is None:
            noise = torch.rand(x.shape, dtype=torch.float32, device=x.device)
        codes = stochastic_round_to_e2m1_codes(scaled, noise)
    return pack_e2m1(codes), scale_e4m3


def dequantize_blocks(values: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """float32 element values [..., R, C] times their block's scale_inv [..., R/br, C/bc]."""
    vb = block_view(values, block_rows, block_cols)
    return (vb * expand_block_scale(scale_inv.to(torch.float32))).reshape(values.shape)
