"""SwiGLU and ScaledSwiGLU: ``silu(gate) * up`` with the last dim split in halves ``[gate | up]``.

``limit`` clamps as GPT-OSS does before the product: ``gate <= limit`` and ``-limit <= up <= limit``
(gradients are zero where a value was clamped). ScaledSwiGLU multiplies each row by an extra input
``scales[T]`` (the routing probability; Megatron applies it before the second expert GEMM), and
returns the gradient of the scales too.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ...lazy_import import optional_module
from ..op import BasicOperation

__all__ = ["SwiGLU", "ScaledSwiGLU", "swiglu_forward", "swiglu_backward", "scaled_swiglu_forward",
           "scaled_swiglu_backward", "Fp8Input", "scaled_swiglu_forward_keeping_fp8"]

_aten = torch.ops.aten


def _check_limit(limit):
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
        raise ValueError(f"SwiGLU limit must be a positive number or None, got {limit=!r}")
    return None if limit is None else float(limit)


_compile = None


def _compile_module():
    """te_dist.quantization.compile, imported on first use (keeps `import te_dist.ops` light)."""
    global _compile
    if _compile is None:
        from ...quantization import compile as module

        _compile = module
    return _compile


def _fused(fn, x, *args):
    """Run a pure elementwise function compiled on CUDA (one kernel instead of 3-8 eager passes
    over non-contiguous halves), eagerly elsewhere: see te_dist.quantization.compile."""
    return _compile_module().dispatch(fn, x, *args)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _swiglu_forward_kernel(x: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def swiglu_forward(x: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    return _fused(_swiglu_forward_kernel, x, limit)


def _scaled_swiglu_forward_kernel(x: torch.Tensor, probs: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    s = _swiglu_forward_kernel(x, limit)
    return s * probs.to(s.dtype).unsqueeze(-1)


def scaled_swiglu_forward(x: torch.Tensor, probs: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    """``swiglu(x) * probs[:, None]`` in one compiled pass (the input of a quantized fc2; without
    quantization the probabilities ride in fc2's row-scale epilogue instead)."""
    return _fused(_scaled_swiglu_forward_kernel, x, probs, limit)


class Fp8Input(NamedTuple):
    """The SwiGLU input kept for the backward as E4M3 with one power-of-two scale per 1x128 block
    of a row (``h ~ data * scale_inv``): half of h's bytes (the grouped MLP under FP8 recipes)."""

    data: torch.Tensor  # [T, 2F] float8_e4m3fn
    scale_inv: torch.Tensor  # [T, 2F / 128] float32
    dtype: torch.dtype  # h's dtype: what dh is returned in

    def dequantize(self) -> torch.Tensor:
        rows, width = self.data.shape
        blocks = self.data.float().view(rows, width // 128, 128) * self.scale_inv.unsqueeze(-1)
        return blocks.view(rows, width).to(self.dtype)


def scaled_swiglu_forward_keeping_fp8(h: torch.Tensor, probs: torch.Tensor, limit: Optional[float],
                                      tell_amax: bool = False):
    """``(swiglu(h) * probs[:, None], Fp8Input)`` from one pass over h (the Triton kernel of
    :mod:`.swiglu_triton`), or None where that kernel cannot run (not CUDA, no Triton, compilation
    off, F not a multiple of 128): the caller then keeps h itself. ``tell_amax``: the pass also finds
    max |swiglu(h) * probs| for a current-scaling cast of it (te_dist.quantization.amax_hints)."""
    if not (h.is_cuda and h.dim() == 2 and (h.shape[1] // 2) % 128 == 0 and _compile_module().compile_enabled(h.device)):
        return None
    triton_module = _triton_module()
    if triton_module is None:
        return None
    scaled, data, scale_inv = triton_module.scaled_swiglu_forward_fp8(h, probs, limit, tell_amax)
    return scaled, Fp8Input(data, scale_inv, h.dtype)


def _scaled_swiglu_backward_kernel(da: torch.Tensor, h: torch.Tensor, probs: torch.Tensor, limit: Optional[float]):
    """Pure function behind :func:`scaled_swiglu_backward`, computed in fp32, rounded once."""
    gate_in, up_in = h.float().chunk(2, dim=-1)
    gate, up = gate_in, up_in
    if limit is not None:
        gate = gate_in.clamp(max=limit)
        up = up_in.clamp(-limit, limit)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    s = silu * up
    d = da.float()
    p = probs.float().unsqueeze(-1)
    dprobs = (d * s).sum(-1)
    dp = d * p
    dgate = dp * up * (sig * (1.0 + gate * (1.0 - sig)))
    dup = dp * silu
    if limit is not None:
        dgate = dgate * (gate_in <= limit)
        dup = dup * ((up_in >= -limit) & (up_in <= limit))
    return torch.cat((dgate, dup), dim=-1).to(h.dtype), dprobs, (s * p).to(h.dtype)


def scaled_swiglu_backward(da: torch.Tensor, h, probs: torch.Tensor, limit: Optional[float],
                           want_scaled: bool = True, tell_amax: bool = False):
    """Backward of ``y = swiglu(h) * probs[:, None]`` given ``da = dL/dy``, in one pass over h and da
    (h a tensor, or the :class:`Fp8Input` the forward kept: read as FP8 by the Triton kernel,
    dequantized first elsewhere).

    Returns ``(dh, dprobs_fp32, swiglu(h) * probs)``: the last one is what the grouped MLP's second
    GEMM needs for its weight gradient, formed here so it costs one write instead of another pass
    (None when not ``want_scaled``: a quantized fc2 saved its FP8 copy in the forward).
    On CUDA it runs the Triton kernel of :mod:`.swiglu_triton` when compilation is enabled (one
    kernel instead of Inductor's two), else the compiled function, else eager ops. ``tell_amax``: the Triton
    kernel also finds max |dh| for a current-scaling cast of dh (te_dist.quantization.amax_hints).
    """
    if isinstance(h, Fp8Input):
        triton_module = _triton_module() if _compile_module().compile_enabled(h.data.device) else None
        if h.data.is_cuda and triton_module is not None:
            return triton_module.scaled_swiglu_backward(da, h.data, probs, limit, want_scaled, h_scale_inv=h.scale_inv,
                                                        out_dtype=h.dtype, tell_amax=tell_amax)
        h = h.dequantize()
    if _compile_module().compile_enabled(h.device):
        if h.is_cuda and h.dim() == 2:
            triton_module = _triton_module()
            if triton_module is not None:
                return triton_module.scaled_swiglu_backward(da, h, probs, limit, want_scaled, tell_amax=tell_amax)
        out = _fused(_scaled_swiglu_backward_kernel, da, h, probs, limit)
    else:
        out = _scaled_swiglu_backward_eager(da, h, probs, limit)
    return out if want_scaled else (*out[:2], None)


def _triton_module():
    """:mod:`.swiglu_triton`, imported on first CUDA use; None (with one warning) without Triton."""
    return optional_module(".swiglu_triton", __package__, "te_dist SwiGLU Triton kernel", "the compiled function")


def _scaled_swiglu_backward_eager(da: torch.Tensor, h: torch.Tensor, probs: torch.Tensor, limit: Optional[float]):
    """The same fp32 math as the kernel in fewer eager ops (aten silu / silu_backward instead of the
    sigmoid algebra Inductor fuses, casts only when needed): uncompiled (CPU) every op pays its dispatch,
    so 12 ops instead of 17 (docs/fusion.md). Equal to the kernel within fp32 rounding."""
    gate_in, up_in = _as(h, torch.float32).chunk(2, dim=-1)
    gate, up = gate_in, up_in
    if limit is not None:
        gate = gate_in.clamp(max=limit)
        up = up_in.clamp(-limit, limit)
    silu = torch.nn.functional.silu(gate)
    s = silu * up
    d = _as(da, torch.float32)
    p = _as(probs, torch.float32).unsqueeze(-1)
    dprobs = (d * s).sum(-1)
    dp = d * p
    dgate = _aten.silu_backward(dp * up, gate)
    dup = dp * silu
    if limit is not None:
        dgate = dgate * (gate_in <= limit)
        dup = dup * ((up_in >= -limit) & (up_in <= limit))
    return _as(torch.cat((dgate, dup), dim=-1), h.dtype), dprobs, _as(s.mul_(p), h.dtype)


def swiglu_backward(dy: torch.Tensor, x: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    return _fused(_swiglu_backward_kernel, dy, x, limit)


def _swiglu_backward_kernel(dy: torch.Tensor, x: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    gate_in, up_in = x.chunk(2, dim=-1)
    gate, up = gate_in, up_in
    if limit is not None:
        gate = gate_in.clamp(max=limit)
        up = up_in.clamp(-limit, limit)
    dgate = _aten.silu_backward(dy * up, gate)
    dup = dy * torch.nn.functional.silu(gate)
    if limit is not None:
        dgate = dgate * (gate_in <= limit)
        dup = dup * ((up_in >= -limit) & (up_in <= limit))
    return torch.cat((dgate, dup), dim=-1)


def _check_even(x):
    if x.shape[-1] % 2:
        raise ValueError(f"SwiGLU needs an even last dim ([gate | up]), got {tuple(x.shape)=}")


class SwiGLU(BasicOperation):
    def __init__(self, limit: Optional[float] = None):
        super().__init__()
        self.limit = _check_limit(limit)

    def op_forward(self, ctx, x, extra_inputs, recipe):
        _check_even(x)
        if ctx.requires_grad:
            ctx.saved = (x,)
        return swiglu_forward(x, self.limit), ()

    def op_backward(self, ctx, dy, grad_extra_outputs):
        (x,) = ctx.saved
        ctx.saved = ()
        return swiglu_backward(dy, x, self.limit), [], ()

    def extra_repr(self) -> str:
        return f"limit={self.limit}" if self.limit is not None else ""


class ScaledSwiGLU(SwiGLU):
    """``swiglu(x) * scales[:, None]``; extra input ``scales`` of shape [T] (x is [T, 2F])."""

    num_extra_inputs = 1

    @staticmethod
    def check_scales(x: torch.Tensor, scales) -> torch.Tensor:
        if not isinstance(scales, torch.Tensor):
            raise TypeError(f"ScaledSwiGLU scales must be a tensor of shape [T], got {type(scales).__name__}")
        if x.dim() != 2:
            raise ValueError(f"ScaledSwiGLU expects a 2-D input [T, 2F], got {tuple(x.shape)=}")
        if scales.dim() == 2 and scales.shape[1] == 1:
            scales = scales.reshape(-1)
        if scales.dim() != 1 or scales.shape[0] != x.shape[0]:
            raise ValueError(f"ScaledSwiGLU scales must have shape [{x.shape[0]}], got {tuple(scales.shape)=}")
        if scales.device != x.device:
            raise ValueError(f"ScaledSwiGLU scales on {scales.device} but input on {x.device}")
        return scales

    def op_forward(self, ctx, x, extra_inputs, recipe):
        _check_even(x)
        (scales,) = extra_inputs
        scales_in = scales
        scales = self.check_scales(x, scales)
        if ctx.requires_grad:
            ctx.saved = (x, scales, scales_in.shape, scales_in.requires_grad)
        # the grouped-MLP fusion forms its quantized fc2 input with the same pass: fused == unfused
        return scaled_swiglu_forward(x, scales, self.limit), ()

    def op_backward(self, ctx, dy, grad_extra_outputs):
        x, scales, scales_shape, scales_requires_grad = ctx.saved
        ctx.saved = ()
        dx, dscales, _ = scaled_swiglu_backward(dy, x, scales, self.limit, want_scaled=False)
        dscales = dscales.to(scales.dtype).reshape(scales_shape) if scales_requires_grad else None
        return dx, [], (dscales,)
