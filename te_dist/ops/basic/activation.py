"""Elementwise activations GELU and ReLU with explicit backward (aten's fused backward kernels).

Both save their *input* (never their output: the fuser's output must not be held by its own
autograd node). ``act_forward`` / ``act_backward`` are the functional core fused ops call.
"""

from __future__ import annotations

import torch

from ..op import BasicOperation

__all__ = ["GELU", "ReLU"]

_aten = torch.ops.aten


class _Activation(BasicOperation):
    def act_forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def act_backward(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def op_forward(self, ctx, x, extra_inputs, recipe):
        if ctx.requires_grad:
            ctx.saved = (x,)
        return self.act_forward(x), ()

    def op_backward(self, ctx, dy, grad_extra_outputs):
        (x,) = ctx.saved
        ctx.saved = ()
        return self.act_backward(dy, x), [], ()


class GELU(_Activation):
    """GELU; ``approximate="tanh"`` (TransformerEngine's default) or ``"none"`` (exact, torch's default)."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximate must be 'none' or 'tanh', got {approximate=!r}")
        self.approximate = approximate

    def act_forward(self, x):
        return torch.nn.functional.gelu(x, approximate=self.approximate)

    def act_backward(self, dy, x):
        return _aten.gelu_backward(dy, x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class ReLU(_Activation):
    def act_forward(self, x):
        return torch.relu(x)

    def act_backward(self, dy, x):
        return _aten.threshold_backward(dy, x, 0)
