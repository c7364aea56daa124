"""Fused ops and their rules. Nothing here registers itself: the fuser class builds its registry
from :func:`default_fusion_rules` (one explicit list), so importing a module never changes rules."""

from .backward_activation_bias import BACKWARD_ACTIVATION_BIAS, BackwardActivationBias
from .forward_linear_bias_activation import (
    FORWARD_LINEAR_BIAS,
    FORWARD_LINEAR_BIAS_ACTIVATION,
    ForwardLinearBiasActivation,
)
from .grouped_mlp import BACKWARD_GROUPED_MLP, FORWARD_GROUPED_MLP, GroupedMLP

__all__ = [
    "ForwardLinearBiasActivation", "BackwardActivationBias", "GroupedMLP", "default_fusion_rules",
    "FORWARD_LINEAR_BIAS_ACTIVATION", "FORWARD_LINEAR_BIAS", "BACKWARD_ACTIVATION_BIAS",
    "FORWARD_GROUPED_MLP", "BACKWARD_GROUPED_MLP",
]


def default_fusion_rules() -> tuple:
    """The rules every OperationFuser starts with (longest patterns are tried first)."""
    return (
        FORWARD_GROUPED_MLP,
        BACKWARD_GROUPED_MLP,
        FORWARD_LINEAR_BIAS_ACTIVATION,
        FORWARD_LINEAR_BIAS,
        BACKWARD_ACTIVATION_BIAS,
    )
