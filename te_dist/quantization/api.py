"""Public entry points: ``make_quantizer``, ``quantize``, ``fake_quantize``.

``quantize(x, recipe, role)`` is stateless: it builds a fresh quantizer for the call. For
DelayedScaling that quantizer is warm-started with x's own amax (as if the history held only x),
so the result equals current scaling with the recipe's margin; use ``make_quantizer`` for real
delayed (history-based) scaling across steps.

Recipes with ``backward_override`` ("high_precision" / "dequantized") still get a grad_output
quantizer here; whether backward GEMMs use it is the op's decision.
"""

from __future__ import annotations

import torch

from ..recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from .blockwise import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer
from .formats import check_input, check_role
from .per_tensor import CurrentScalingQuantizer, DelayedScalingQuantizer
from .quantizer import Quantizer
from .tensors import BlockScaledTensor, QuantizedTensor

__all__ = ["QUANTIZER_TYPES", "make_quantizer", "quantize", "fake_quantize"]

QUANTIZER_TYPES = {
    DelayedScaling: DelayedScalingQuantizer,
    Float8CurrentScaling: CurrentScalingQuantizer,
    Float8BlockScaling: Float8BlockQuantizer,
    MXFP8BlockScaling: MXFP8Quantizer,
    NVFP4BlockScaling: NVFP4Quantizer,
}


def make_quantizer(recipe: Recipe, role: str, *, group=None, **options) -> Quantizer:
    """A new quantizer for ``role`` ("input" | "weight" | "grad_output") built for ``recipe``'s
    current settings. ``group``: amax reduction group (DelayedScaling with reduce_amax, or an
    explicit group for current scaling). ``options``: quantizer-specific (NVFP4: ``generator``)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"make_quantizer needs a te_dist.recipe.Recipe, got {type(recipe).__name__}")
    check_role(role)
    cls = QUANTIZER_TYPES.get(type(recipe))
    if cls is None:
        raise TypeError(
            f"no quantizer for recipe type {type(recipe).__name__}; expected one of "
            f"{[t.__name__ for t in QUANTIZER_TYPES]}"
        )
    return cls(recipe, role, group=group, **options)


def quantize(x: torch.Tensor, recipe: Recipe, role: str, *, rowwise: bool = True, columnwise: bool = False) -> QuantizedTensor:
    """Quantize x for ``role`` with a fresh quantizer (see the module docstring for DelayedScaling)."""
    check_input(x)
    quantizer = make_quantizer(recipe, role)
    if isinstance(quantizer, DelayedScalingQuantizer):
        quantizer.observe(x)
    return quantizer(x, rowwise=rowwise, columnwise=columnwise)


class _FakeQuantize(torch.autograd.Function):
    """Forward: quantize -> dequantize. Backward: straight-through (identity)."""

    @staticmethod
    def forward(ctx, x, quantizer, usage, options):
        q = quantizer(x, rowwise=usage == "rowwise", columnwise=usage == "columnwise", **options)
        if isinstance(q, BlockScaledTensor):
            return q.dequantize(usage=usage)
        return q.dequantize()

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def fake_quantize(x: torch.Tensor, quantizer: Quantizer, *, usage: str = "rowwise", **call_options) -> torch.Tensor:
    """quantize -> dequantize with the same shape and dtype as x; gradients pass straight through.

    ``usage="columnwise"`` quantizes along x's second-to-last dim instead of its last.
    ``call_options`` (e.g. ``hadamard=True``) go to the quantizer call.
    """
    if not isinstance(quantizer, Quantizer):
        raise TypeError(f"fake_quantize needs a Quantizer (see make_quantizer), got {type(quantizer).__name__}")
    if usage not in ("rowwise", "columnwise"):
        raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
    check_input(x)
    return _FakeQuantize.apply(x, quantizer, usage, call_options)
