"""Quantize: fake-quantize the activation (forward, role "input") and its gradient (backward,
role "grad_output") under the active recipe; identity without one.

Why an op: it marks where a tensor crosses a quantization boundary that is not a GEMM operand
(for example before a communication op), with the same recipe state rules as the GEMM ops.
"""

from __future__ import annotations

from ..op import BasicOperation
from ._quant import GemmQuantizers, fake_quantize_or_identity

__all__ = ["Quantize"]


class Quantize(BasicOperation):
    def __init__(self, forward: bool = True, backward: bool = True):
        super().__init__()
        self.quantize_forward = bool(forward)
        self.quantize_backward = bool(backward)
        self._quantizers = GemmQuantizers(None)

    def reset_recipe_state(self, recipe) -> None:
        self._quantizers = GemmQuantizers(recipe, roles=("input", "grad_output"))

    @property
    def quantizers(self) -> GemmQuantizers:
        return self._quantizers

    def op_forward(self, ctx, x, extra_inputs, recipe):
        q = self._quantizers.input if self.quantize_forward else None
        return fake_quantize_or_identity(x, q), ()

    def op_backward(self, ctx, dy, grad_extra_outputs):
        q = self._quantizers.grad_output if self.quantize_backward else None
        return fake_quantize_or_identity(dy, q), [], ()

    def extra_repr(self) -> str:
        return f"forward={self.quantize_forward}, backward={self.quantize_backward}"
