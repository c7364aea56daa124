"""One-pass Triton kernel for the scaled SwiGLU backward of the grouped MLP.

Why: compiled by Inductor, ``_scaled_swiglu_backward_kernel`` became two kernels, a pointwise
pass for ``dh`` and ``swiglu(h) * probs`` and a reduction that reads ``h`` and ``da`` again for
the probability gradient (docs/fusion.md has the figures). Here one program owns a row, streams
``[gate | up]`` and ``da`` once, writes both outputs and sums ``da * swiglu(h)`` on the way. Launching
it also skips the compiled region's guards, which cost host time on every call.

Same fp32 math as :func:`te_dist.ops.basic.swiglu._scaled_swiglu_backward_kernel` (the sum's
order differs). The library imports it only through :mod:`.swiglu`, on CUDA: CI has no Triton.

Under an FP8 recipe the grouped MLP keeps the SwiGLU input for the backward in FP8 (E4M3, one
power-of-two scale per 1x128 block of a row, as DeepSeek-V3 stores it): the input is the largest
tensor the expert MLP saves (``[T, 2F]``). ``scaled_swiglu_forward_fp8`` writes that copy in the
same pass that forms ``swiglu(h) * probs`` (h is read once, as before), and the backward reads the
FP8 copy instead of h, so the bytes moved per step stay the same while the saved input halves.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...quantization import amax_hints
from ...quantization.triton_fp8_math import _abs_bits, _block_scale, _merge_amax, _saturate
from ...quantization.triton_launch import launch, next_power_of_2

__all__ = ["scaled_swiglu_backward", "scaled_swiglu_forward_fp8", "FP8_BLOCK"]

FP8_BLOCK = 128  # columns per scale block of the FP8 copy of h; F must be a multiple
_E4M3_MAX = tl.constexpr(448.0)  # a global a jit function reads must be a constexpr

_MAX_BLOCK = 1024  # columns per loop step of the backward: 8 bf16 (16 bytes) per thread with 4 warps
_FWD_NB = 2  # 128-column blocks per half and loop step of the FP8 forward, one warp: 8 elements per thread


def forward_launch(half: int):
    """(blocks of 128 columns per half and loop step, num_warps) of the FP8 forward: one warp (docs/fusion.md,
    "SwiGLU launches")."""
    return min(_FWD_NB, next_power_of_2(half // FP8_BLOCK)), 1


def backward_launch(half: int, h_fp8: bool):
    """(BLOCK, num_warps) of the backward for rows of ``half`` = F columns. Reading the FP8 copy of h, about
    four loop steps a row with 256 columns per warp (1-4 warps): rows are short and many, and narrow programs
    keep more of them in flight (docs/fusion.md, "SwiGLU launches"); reading bf16 h, one 4-warp step of up to
    1024 columns, which measured as fast or faster there."""
    width = next_power_of_2(half)
    if not h_fp8:
        return min(_MAX_BLOCK, max(16, width)), 4
    block = min(_MAX_BLOCK, max(min(256, width), width // 4))
    return block, max(1, block // 256)


@triton.jit
def _rounded_abs_bits(y, mask, out_ptr):
    """|y| rounded to out_ptr's dtype (what is stored there) as int32 float32 bits, 0 where masked: what an amax
    pass over the stored tensor sees."""
    return tl.where(mask, _abs_bits(y.to(out_ptr.dtype.element_ty).to(tl.float32)), 0)


@triton.jit
def _clamp(gate_in, up_in, limit, HAS_LIMIT: tl.constexpr):
    """GPT-OSS's clamp before the product: gate <= limit, -limit <= up <= limit."""
    if HAS_LIMIT:
        gate = tl.minimum(gate_in, limit)
        up = tl.minimum(tl.maximum(up_in, -limit), limit)
    else:
        gate = gate_in
        up = up_in
    return gate, up


@triton.jit
def _scaled_swiglu_backward_rows(da_ptr, h_ptr, hs_ptr, p_ptr, dh_ptr, s_ptr, dp_ptr, amax_ptr, F, limit,
                                 HAS_LIMIT: tl.constexpr, WRITE_S: tl.constexpr, H_FP8: tl.constexpr,
                                 AMAX: tl.constexpr, BLOCK: tl.constexpr):
    """H_FP8: h is the FP8 copy, dequantized on load with its 1x128 block scales hs [T, 2F/128]. AMAX: max |dh|
    merged into amax_ptr (int32 bits; quantization.amax_hints)."""
    row = tl.program_id(0).to(tl.int64)
    h_row = h_ptr + row * 2 * F
    hs_row = hs_ptr + row * (F // 64)  # 2F / 128 block scales per row
    dh_row = dh_ptr + row * 2 * F
    da_row = da_ptr + row * F
    s_row = s_ptr + row * F
    p = tl.load(p_ptr + row).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    top = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, F, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < F
        gate_in = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
        up_in = tl.load(h_row + F + cols, mask=mask, other=0.0).to(tl.float32)
        if H_FP8:
            gate_in = gate_in * tl.load(hs_row + cols // 128, mask=mask, other=0.0)
            up_in = up_in * tl.load(hs_row + (F + cols) // 128, mask=mask, other=0.0)
        d = tl.load(da_row + cols, mask=mask, other=0.0).to(tl.float32)
        gate, up = _clamp(gate_in, up_in, limit, HAS_LIMIT)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        s = silu * up
        acc += d * s  # masked columns load d = 0
        dp = d * p
        dgate = dp * up * (sig * (1.0 + gate * (1.0 - sig)))
        dup = dp * silu
        if HAS_LIMIT:
            dgate = tl.where(gate_in <= limit, dgate, 0.0)
            dup = tl.where((up_in >= -limit) & (up_in <= limit), dup, 0.0)
        tl.store(dh_row + cols, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_row + F + cols, dup.to(dh_ptr.dtype.element_ty), mask=mask)
        if AMAX:
            top = tl.maximum(top, tl.maximum(_rounded_abs_bits(dgate, mask, dh_ptr),
                                             _rounded_abs_bits(dup, mask, dh_ptr)))
        if WRITE_S:
            tl.store(s_row + cols, (s * p).to(s_ptr.dtype.element_ty), mask=mask)
    tl.store(dp_ptr + row, tl.sum(acc, axis=0))
    if AMAX:
        _merge_amax(amax_ptr, tl.max(top, axis=0))


def scaled_swiglu_backward(da: torch.Tensor, h: torch.Tensor, probs: torch.Tensor, limit: Optional[float],
                           want_scaled: bool = True, h_scale_inv: Optional[torch.Tensor] = None,
                           out_dtype: Optional[torch.dtype] = None, tell_amax: bool = False, launch_shape=None):
    """``(dh, dprobs_fp32, swiglu(h) * probs)`` for ``h [T, 2F]``, ``da [T, F]``, ``probs [T]`` (CUDA);
    the last is None when not ``want_scaled`` (a quantized fc2 saved its own FP8 copy of it).
    With ``h_scale_inv`` [T, 2F/128], h is the FP8 copy from :func:`scaled_swiglu_forward_fp8` and
    ``out_dtype`` the dtype of dh (and of the scaled output). ``tell_amax``: max |dh| from the same pass,
    offered to a current-scaling cast of dh (quantization.amax_hints). ``launch_shape``: (BLOCK, num_warps)
    instead of :func:`backward_launch` (benchmarks/quantize.py swiglu)."""
    rows, width = h.shape
    half = width // 2
    h, da, probs = h.contiguous(), da.contiguous(), probs.contiguous()
    out_dtype = out_dtype or h.dtype
    dh = torch.empty(rows, width, dtype=out_dtype, device=h.device)
    scaled = torch.empty(rows, half, dtype=out_dtype, device=h.device) if want_scaled else None
    dprobs = torch.empty(rows, dtype=torch.float32, device=h.device)
    if rows and half:
        fp8 = h_scale_inv is not None
        block, warps = launch_shape or backward_launch(half, fp8)
        bits = amax_hints.new_bits(h.device) if tell_amax else dprobs
        launch(_scaled_swiglu_backward_rows, (rows,),
            da, h, h_scale_inv.contiguous() if fp8 else probs, probs, dh, dh if scaled is None else scaled, dprobs,
            bits, half, 0.0 if limit is None else float(limit),
            HAS_LIMIT=limit is not None, WRITE_S=want_scaled, H_FP8=fp8, AMAX=tell_amax, BLOCK=block, num_warps=warps,
        )
        if tell_amax:
            amax_hints.offer(dh, bits)
    elif rows:
        dprobs.zero_()
    return dh, dprobs, scaled


@triton.jit
def _scaled_swiglu_forward_fp8_rows(h_ptr, p_ptr, s_ptr, hq_ptr, hs_ptr, amax_ptr, F, nblk, limit,
                                    HAS_LIMIT: tl.constexpr, AMAX: tl.constexpr, NB: tl.constexpr):
    """One row: s = swiglu(h) * p, and h's FP8 copy with one scale per 128 columns (nblk = F / 128
    blocks per half); NB blocks of the gate half and NB of the up half per step. AMAX: max |s| merged into
    amax_ptr (int32 bits; quantization.amax_hints)."""
    row = tl.program_id(0).to(tl.int64)
    h_row = h_ptr + row * 2 * F
    hq_row = hq_ptr + row * 2 * F
    hs_row = hs_ptr + row * 2 * nblk
    s_row = s_ptr + row * F
    p = tl.load(p_ptr + row).to(tl.float32)
    k = tl.arange(0, 128)
    top = tl.zeros([NB, 128], dtype=tl.int32)
    for c0 in range(0, F, 128 * NB):
        blk = c0 // 128 + tl.arange(0, NB)
        cols = blk[:, None] * 128 + k[None, :]  # [NB, 128]
        mask = blk[:, None] < nblk
        gate_in = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
        up_in = tl.load(h_row + F + cols, mask=mask, other=0.0).to(tl.float32)
        g_mult, g_inv = _block_scale(tl.max(_abs_bits(gate_in), axis=1), _E4M3_MAX, True, False, 0, 0)
        u_mult, u_inv = _block_scale(tl.max(_abs_bits(up_in), axis=1), _E4M3_MAX, True, False, 0, 0)
        tl.store(hq_row + cols, _saturate(gate_in * g_mult[:, None], _E4M3_MAX).to(hq_ptr.dtype.element_ty), mask=mask)
        tl.store(hq_row + F + cols, _saturate(up_in * u_mult[:, None], _E4M3_MAX).to(hq_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(hs_row + blk, g_inv, mask=blk < nblk)
        tl.store(hs_row + nblk + blk, u_inv, mask=blk < nblk)
        gate, up = _clamp(gate_in, up_in, limit, HAS_LIMIT)
        s = gate * tl.sigmoid(gate) * up * p
        tl.store(s_row + cols, s.to(s_ptr.dtype.element_ty), mask=mask)
        if AMAX:
            top = tl.maximum(top, _rounded_abs_bits(s, mask, s_ptr))
    if AMAX:
        _merge_amax(amax_ptr, tl.max(tl.max(top, axis=1), axis=0))


def scaled_swiglu_forward_fp8(h: torch.Tensor, probs: torch.Tensor, limit: Optional[float], tell_amax: bool = False,
                              launch_shape=None):
    """``(swiglu(h) * probs[:, None], h_fp8, h_scale_inv)`` for ``h [T, 2F]`` (F a multiple of 128)
    in one pass over h: h_fp8 is E4M3 ``[T, 2F]``, h_scale_inv float32 ``[T, 2F/128]`` (powers of two,
    one per 1x128 block, ``h ~ h_fp8 * h_scale_inv``). ``tell_amax``: max of the first output's magnitudes from the
    same pass, offered to a current-scaling cast of it (quantization.amax_hints). ``launch_shape``: (blocks per
    half and step, num_warps) instead of :func:`forward_launch` (benchmarks/quantize.py swiglu)."""
    rows, width = h.shape
    half = width // 2
    if half % FP8_BLOCK:
        raise ValueError(f"the FP8 copy of the SwiGLU input needs F a multiple of {FP8_BLOCK}, received F={half}")
    h, probs = h.contiguous(), probs.contiguous()
    scaled = torch.empty(rows, half, dtype=h.dtype, device=h.device)
    h_fp8 = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=h.device)
    h_scale_inv = torch.empty(rows, width // FP8_BLOCK, dtype=torch.float32, device=h.device)
    if rows and half:
        nb, warps = launch_shape or forward_launch(half)
        bits = amax_hints.new_bits(h.device) if tell_amax else h_scale_inv
        launch(_scaled_swiglu_forward_fp8_rows, (rows,),
            h, probs, scaled, h_fp8, h_scale_inv, bits, half, half // FP8_BLOCK, 0.0 if limit is None else float(limit),
            HAS_LIMIT=limit is not None, AMAX=tell_amax, NB=nb, num_warps=warps,
        )
        if tell_amax:
            amax_hints.offer(scaled, bits)
    return scaled, h_fp8, h_scale_inv
