"""Bias: ``y = x + bias`` over the last dim; backward sums the gradient over all other dims."""

from __future__ import annotations

import torch

from ..op import BasicOperation

__all__ = ["Bias"]


class Bias(BasicOperation):
    def __init__(self, size: int, *, device=None, dtype=None):
        super().__init__()
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"Bias size must be a positive int, got {size=!r}")
        self.size = size
        self.bias = torch.nn.Parameter(torch.zeros(size, device=device, dtype=dtype))

    def check_input(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.size:
            raise ValueError(f"Bias expects input last dim {self.size}, got {tuple(x.shape)=}")

    @staticmethod
    def bias_grad(dy: torch.Tensor) -> torch.Tensor:
        return dy.sum(0) if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1]).sum(0)

    def op_forward(self, ctx, x, extra_inputs, recipe):
        self.check_input(x)
        if ctx.requires_grad:
            ctx.saved = (self.bias.requires_grad,)
        return x + self.bias, ()

    def op_backward(self, ctx, dy, grad_extra_outputs):
        (bias_requires_grad,) = ctx.saved
        db = self.bias_grad(dy) if bias_requires_grad else None
        return dy, [db], ()

    def extra_repr(self) -> str:
        return f"size={self.size}"
