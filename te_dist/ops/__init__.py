"""Fusible operations.

Basic ops (``basic/``) own parameters and recipe state; fused ops (``fused/``) replace runs of
basic ops and own nothing; :class:`OperationFuser` picks a :class:`FusionPlan` per call keyed by
``(recipe key, first_op_requiring_backward)``; :class:`Sequential` groups consecutive basic ops
into fusers. See docs/fusion.md.
"""

from .basic import (
    GELU,
    AllGather,
    AllReduce,
    BasicLinear,
    Bias,
    GroupedLinear,
    GroupSplits,
    Quantize,
    ReduceScatter,
    ReLU,
    RowGather,
    ScaledSwiGLU,
    SwiGLU,
)
from .fused import BackwardActivationBias, ForwardLinearBiasActivation, GroupedMLP, default_fusion_rules
from .fuser import FusionPlan, OperationFuser, PlanStep, fusion_rules_scope
from .op import BasicOperation, FusedOperation, FusibleOperation, OpContext
from .rules import FusionRule, FusionRuleRegistry
from .sequential import Sequential

__all__ = [
    "FusibleOperation", "BasicOperation", "FusedOperation", "OpContext",
    "OperationFuser", "FusionPlan", "PlanStep", "Sequential",
    "FusionRule", "FusionRuleRegistry", "fusion_rules_scope", "default_fusion_rules",
    "BasicLinear", "Bias", "GELU", "ReLU", "SwiGLU", "ScaledSwiGLU", "GroupedLinear", "GroupSplits", "RowGather",
    "Quantize", "AllGather", "ReduceScatter", "AllReduce",
    "ForwardLinearBiasActivation", "BackwardActivationBias", "GroupedMLP",
]
