"""BasicLinear's native FP8 path: the dense GEMM run as one group of the quantized grouped kernels.

Why one group: the grouped FP8 entry points (``te_dist.kernels.grouped_mm_quantized_*``) already take
every FP8 recipe's scaling (per-tensor, 1x128 / 128x128 blocks) in all three directions, with a
prepared weight copy in both GEMM layouts; a dense layer ``y = x @ W.T`` is their E = 1 case
(offsets ``[T]``), so there is no second FP8 GEMM stack to keep. The weight copy follows the grouped
layers' rule (:mod:`.weight_copy`: cast at every forward unless ``is_first_microbatch`` says the weights
did not change since the step's first micro-batch).

Taken when ``te_dist.settings.fp8_dense_native`` is on, the recipe quantizes its backward too (no
``backward_override``), the support predicate says the grouped kernels run for x's dtype and device
with T rows as the one group's size, and both local features are multiples of 128 (the kernels' scale
block); else BasicLinear's emulated path (fake-quantize, then the bf16 GEMM).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ... import settings
from .feature_padding import GRID  # both features: the FP8 kernels' scale block
from .weight_copy import WeightCopy, check_microbatch_flag

__all__ = ["DenseFP8", "DenseFP8Saved"]

class DenseFP8Saved(NamedTuple):
    """What the native forward keeps for backward (BasicLinear tells its two paths apart by this type)."""

    x_wgrad: Optional[object]  # the quantized input as wgrad reads it (None: the weight needs no gradient)
    weight: object  # the prepared weight copy (both layouts)
    offsets: torch.Tensor  # int32 [1] = [T] on x's device
    x_shape: torch.Size  # the op input's (dx is reshaped to it)
    weight_requires_grad: bool


class DenseFP8:
    """One BasicLinear's native FP8 state: its weight copy and the one-group offsets of the last row count."""

    __slots__ = ("weight_copy", "_offsets")

    def __init__(self):
        self.weight_copy = WeightCopy()
        self._offsets = None  # (rows, device, int32 tensor [1]): a step's layers see one row count

    @staticmethod
    def applies(op, x2: torch.Tensor) -> bool:
        """Does this forward of ``op`` (a BasicLinear under an active recipe) take the native path?"""
        q = op.quantizers
        if not settings.current().fp8_dense_native or q.backward_override is not None or not x2.is_cuda:
            return False
        if op.local_in_features % GRID or op.local_out_features % GRID or x2.shape[0] == 0:
            return False
        from ... import support
        from .grouped_linear import host_split_alignment

        return support.is_module_grouped_tensor_supported(
            q.recipe, x2.dtype, split_alignment=host_split_alignment((x2.shape[0],)), device=x2.device)

    def offsets(self, rows: int, device: torch.device) -> torch.Tensor:
        cached = self._offsets
        if cached is None or cached[0] != rows or cached[1] != device:
            cached = self._offsets = (rows, device, torch.full((1,), rows, dtype=torch.int32, device=device))
        return cached[2]

    def quantized_weight(self, op):
        """The weight copy for this forward ([1, N, K], both layouts): kept or cast (see the module doc)."""
        from .grouped_linear import cast_weight_copy

        flag = check_microbatch_flag(op.is_first_microbatch)
        return self.weight_copy.get(op.weight, op.quantizers.settings_key,
                                    lambda: cast_weight_copy(op.quantizers, op.weight.detach().unsqueeze(0)), flag)

    def forward(self, op, ctx, x2: torch.Tensor, bias: Optional[torch.Tensor], x_shape: torch.Size) -> torch.Tensor:
        """``x2 @ W.T (+ bias, fused)`` on the quantized kernels; saves a :class:`DenseFP8Saved` into ctx
        (``x_shape``: the op input's shape, x2 its rows)."""
        from ... import kernels

        q = op.quantizers
        rows = x2.shape[0]
        need_wgrad = ctx.requires_grad and op.weight.requires_grad
        xq = q.input(x2, rowwise=True, columnwise=need_wgrad)
        wq = self.quantized_weight(op)
        offsets = self.offsets(rows, x2.device)
        y = kernels.grouped_mm_quantized_forward(xq, wq, offsets, bias_EN=None if bias is None else bias.unsqueeze(0),
                                                 out_dtype=x2.dtype, group_sizes=(rows,))
        if ctx.requires_grad:
            from .grouped_linear import wgrad_copy

            ctx.saved = DenseFP8Saved(wgrad_copy(xq) if need_wgrad else None, wq, offsets, x_shape,
                                      op.weight.requires_grad)
        return y

    @staticmethod
    def backward(op, saved: DenseFP8Saved, dy2: torch.Tensor, need_dx: bool):
        """``(dx, dweight)`` from one quantization of dy (rowwise for dgrad, columnwise for wgrad)."""
        dyq = op.quantizers.grad_output(dy2, rowwise=need_dx, columnwise=saved.weight_requires_grad)
        return DenseFP8.backward_quantized(op, saved, dyq, need_dx, dy2.dtype)

    @staticmethod
    def backward_quantized(op, saved: DenseFP8Saved, dyq, need_dx: bool, dx_dtype: torch.dtype):
        """``(dx, dweight)`` from dy already quantized by the op's grad_output recipe (both layouts where both
        GEMMs run): what :meth:`backward` does after its cast, for a producer that wrote dy in FP8 itself
        (te_dist.train.head_loss)."""
        from ... import kernels

        rows = dyq.shape[0]
        dx = dw = None
        if need_dx:
            dx = kernels.grouped_mm_quantized_dgrad(dyq, saved.weight, saved.offsets, out_dtype=dx_dtype,
                                                    group_sizes=(rows,))
        if saved.weight_requires_grad:
            dw = kernels.grouped_mm_quantized_wgrad(saved.x_wgrad, dyq, saved.offsets, num_groups=1,
                                                    out_dtype=op.weight.dtype, group_sizes=(rows,))[0]
        return dx, dw

