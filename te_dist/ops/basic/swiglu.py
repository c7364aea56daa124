"""SwiGLU and ScaledSwiGLU: ``silu(gate) * up`` with the last dim split in halves ``[gate | up]``.

``limit`` clamps as GPT-OSS does before the product: ``gate <= limit`` and ``-limit <= up <= limit``
(gradients are zero where a value was clamped). ScaledSwiGLU multiplies each row by an extra input
``scales[T]`` (the routing probability; Megatron applies it before the second expert GEMM), and
returns the gradient of the scales too.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..op import BasicOperation

__all__ = ["SwiGLU", "ScaledSwiGLU", "swiglu_forward", "swiglu_backward"]

_aten = torch.ops.aten


def _check_limit(limit):
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
        raise ValueError(f"SwiGLU limit must be a positive number or None, got {limit=!r}")
    return None if limit is None else float(limit)


def swiglu_forward(x: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def swiglu_backward(dy: torch.Tensor, x: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
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
        s = swiglu_forward(x, self.limit)
        return s * scales.to(s.dtype).unsqueeze(-1), ()

    def op_backward(self, ctx, dy, grad_extra_outputs):
        x, scales, scales_shape, scales_requires_grad = ctx.saved
        ctx.saved = ()
        dscales = None
        if scales_requires_grad:
            s = swiglu_forward(x, self.limit)
            acc = torch.promote_types(dy.dtype, torch.float32)
            dscales = (dy * s).sum(-1, dtype=acc).to(scales.dtype).reshape(scales_shape)
        dx = swiglu_backward(dy * scales.to(dy.dtype).unsqueeze(-1), x, self.limit)
        return dx, [], (dscales,)
