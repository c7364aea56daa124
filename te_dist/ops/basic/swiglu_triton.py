"""One-pass Triton kernel for the scaled SwiGLU backward of the grouped MLP.

Why: compiled by Inductor, ``_scaled_swiglu_backward_kernel`` became two kernels, a pointwise
pass for ``dh`` and ``swiglu(h) * probs`` and a reduction that reads ``h`` and ``da`` again for
the probability gradient: 0.35 ms of a 9.3 ms Mixtral-like EP=2 step on H200
(benchmarks/moe_profile.py). Here one program owns a row, streams ``[gate | up]`` and ``da`` once,
writes both outputs and sums ``da * swiglu(h)`` on the way. Launching it also skips the compiled
region's guards (~0.1 ms of host time per call on the H200 host).

Same fp32 math as :func:`te_dist.ops.basic.swiglu._scaled_swiglu_backward_kernel` (the sum's
order differs). The library imports it only through :mod:`.swiglu`, on CUDA: CI has no Triton.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["scaled_swiglu_backward"]

_MAX_BLOCK = 1024  # columns per loop step: 8 bf16 (16 bytes) per thread with 4 warps


@triton.jit
def _scaled_swiglu_backward_rows(da_ptr, h_ptr, p_ptr, dh_ptr, s_ptr, dp_ptr, F, limit,
                                 HAS_LIMIT: tl.constexpr, WRITE_S: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h_row = h_ptr + row * 2 * F
    dh_row = dh_ptr + row * 2 * F
    da_row = da_ptr + row * F
    s_row = s_ptr + row * F
    p = tl.load(p_ptr + row).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, F, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < F
        gate_in = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
        up_in = tl.load(h_row + F + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(da_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            gate = tl.minimum(gate_in, limit)
            up = tl.minimum(tl.maximum(up_in, -limit), limit)
        else:
            gate = gate_in
            up = up_in
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
        if WRITE_S:
            tl.store(s_row + cols, (s * p).to(s_ptr.dtype.element_ty), mask=mask)
    tl.store(dp_ptr + row, tl.sum(acc, axis=0))


def scaled_swiglu_backward(da: torch.Tensor, h: torch.Tensor, probs: torch.Tensor, limit: Optional[float],
                           want_scaled: bool = True):
    """``(dh, dprobs_fp32, swiglu(h) * probs)`` for ``h [T, 2F]``, ``da [T, F]``, ``probs [T]`` (CUDA);
    the last is None when not ``want_scaled`` (a quantized fc2 saved its own FP8 copy of it)."""
    rows, width = h.shape
    half = width // 2
    h, da, probs = h.contiguous(), da.contiguous(), probs.contiguous()
    dh = torch.empty_like(h)
    scaled = torch.empty(rows, half, dtype=h.dtype, device=h.device) if want_scaled else None
    dprobs = torch.empty(rows, dtype=torch.float32, device=h.device)
    if rows and half:
        block = min(_MAX_BLOCK, max(16, triton.next_power_of_2(half)))
        _scaled_swiglu_backward_rows[(rows,)](
            da, h, probs, dh, dh if scaled is None else scaled, dprobs, half, 0.0 if limit is None else float(limit),
            HAS_LIMIT=limit is not None, WRITE_S=want_scaled, BLOCK=block, num_warps=4,
        )
    elif rows:
        dprobs.zero_()
    return dh, dprobs, scaled
