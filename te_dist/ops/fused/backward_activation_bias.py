"""Backward fusion: Bias -> (GELU | ReLU) gives dact and dbias in one step.

On GPU this is one kernel pass over dy (TransformerEngine's dbias_dgelu); here it is the same
math computed once: ``dx = act'(x) * dy`` and ``dbias = sum(dx)`` reuse the same ``dx``.
"""

from __future__ import annotations

from ..basic import GELU, Bias, ReLU
from ..op import FusedOperation
from ..rules import FusionRule

__all__ = ["BackwardActivationBias", "BACKWARD_ACTIVATION_BIAS"]


class BackwardActivationBias(FusedOperation):
    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        bias, act = self.basic_ops
        bias_ctx, act_ctx = ctxs
        (x,) = act_ctx.saved
        act_ctx.saved = ()
        (bias_requires_grad,) = bias_ctx.saved
        dx = act.act_backward(dy, x)
        db = bias.bias_grad(dx) if bias_requires_grad else None
        return dx, [[db], []], [(), ()]


def _build(ops, recipe):
    return BackwardActivationBias(ops)


BACKWARD_ACTIVATION_BIAS = FusionRule("backward_activation_bias", "backward", (Bias, (GELU, ReLU)), _build)
