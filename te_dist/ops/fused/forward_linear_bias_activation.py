"""Forward fusion: BasicLinear -> Bias (-> GELU | ReLU) as one GEMM with the bias in its epilogue.

Fills each basic op's context exactly as the basic op would, so the backward pass may use the
basic ops or :class:`BackwardActivationBias`.
"""

from __future__ import annotations

from ..basic import GELU, Bias, BasicLinear, ReLU
from ..op import FusedOperation
from ..rules import FusionRule

__all__ = ["ForwardLinearBiasActivation", "FORWARD_LINEAR_BIAS_ACTIVATION", "FORWARD_LINEAR_BIAS"]


class ForwardLinearBiasActivation(FusedOperation):
    def fuser_forward(self, ctxs, x, extra_inputs, recipe):
        linear, bias = self.basic_ops[0], self.basic_ops[1]
        y = linear.linear_forward(ctxs[0], x, bias=bias.bias)
        if ctxs[1].requires_grad:
            ctxs[1].saved = (bias.bias.requires_grad,)
        if len(self.basic_ops) == 3:
            y, _ = self.basic_ops[2].op_forward(ctxs[2], y, (), recipe)
        return y, [()] * len(self.basic_ops)


def _build(ops, recipe):
    linear, bias = ops[0], ops[1]
    if bias.size != linear.local_out_features or bias.bias.dtype != linear.weight.dtype:
        return None
    if bias.bias.device != linear.weight.device:
        return None
    return ForwardLinearBiasActivation(ops)


FORWARD_LINEAR_BIAS_ACTIVATION = FusionRule(
    "forward_linear_bias_activation", "forward", (BasicLinear, Bias, (GELU, ReLU)), _build
)
FORWARD_LINEAR_BIAS = FusionRule("forward_linear_bias", "forward", (BasicLinear, Bias), _build)
