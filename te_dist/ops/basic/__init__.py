"""Basic ops: each owns its parameters and recipe state and has an explicit forward and backward."""

from .activation import GELU, ReLU
from .bias import Bias
from .communication import AllGather, AllReduce, ReduceScatter
from .grouped_linear import GroupedLinear, GroupSplits
from .linear import BasicLinear
from .quantize import Quantize
from .row_gather import RowGather
from .swiglu import ScaledSwiGLU, SwiGLU

__all__ = [
    "BasicLinear", "Bias", "GELU", "ReLU", "SwiGLU", "ScaledSwiGLU", "GroupedLinear", "GroupSplits", "RowGather",
    "Quantize",
    "AllGather", "ReduceScatter", "AllReduce",
]
