"""BasicLinear: ``y = x @ weight.T`` with recipe-quantized operands and optional tensor parallelism.

Tensor-parallel modes (Megatron style, no sequence parallelism):
- ``"column"``: weight holds ``out_features / tp`` rows; input replicated; output sharded on the
  last dim; backward all-reduces dgrad.
- ``"row"``: weight holds ``in_features / tp`` columns; input sharded on the last dim; the output
  is all-reduced (a following bias is added after the reduction by the fused op).

``linear_forward`` / ``linear_backward`` are the functional core the fused ops call.

Under an FP8 recipe the GEMMs run emulated (fake-quantize, then the GEMM in x's dtype), or natively on
the quantized grouped kernels as one group where :mod:`.dense_fp8` says they can (its switch,
``te_dist.settings.fp8_dense_native``, is on by default). The native path keeps its weight copy by the
grouped layers' rule: ``is_first_microbatch`` as in TransformerEngine (:mod:`.weight_copy`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..op import BasicOperation, OpContext
from . import _comm
from ._quant import GemmQuantizers, fake_quantize_or_identity
from .dense_fp8 import DenseFP8, DenseFP8Saved

__all__ = ["BasicLinear"]

_TP_MODES = (None, "column", "row")


class BasicLinear(BasicOperation):
    """Linear layer without bias (compose with :class:`Bias`); weight ``[out_local, in_local]``."""

    def __init__(self, in_features: int, out_features: int, *, device=None, dtype=None,
                 tensor_parallel_mode: Optional[str] = None, tensor_parallel_group=None):
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BasicLinear {name} must be a positive int, got {name}={value!r}")
        if tensor_parallel_mode not in _TP_MODES:
            raise ValueError(f"{tensor_parallel_mode=} is not one of {_TP_MODES}")
        tp_size = _comm.world_size(tensor_parallel_group) if tensor_parallel_mode else 1
        local_in, local_out = in_features, out_features
        if tensor_parallel_mode == "column":
            if out_features % tp_size:
                raise ValueError(f"{out_features=} is not divisible by the tensor-parallel size {tp_size=}")
            local_out = out_features // tp_size
        elif tensor_parallel_mode == "row":
            if in_features % tp_size:
                raise ValueError(f"{in_features=} is not divisible by the tensor-parallel size {tp_size=}")
            local_in = in_features // tp_size
        self.in_features = in_features
        self.out_features = out_features
        self.local_in_features = local_in
        self.local_out_features = local_out
        self.tensor_parallel_mode = tensor_parallel_mode
        self.tensor_parallel_group = tensor_parallel_group
        self.tensor_parallel_size = tp_size
        self._row_parallel = tensor_parallel_mode == "row" and tp_size > 1
        self._column_parallel = tensor_parallel_mode == "column" and tp_size > 1
        self.weight = torch.nn.Parameter(torch.empty(local_out, local_in, device=device, dtype=dtype))
        bound = 1.0 / math.sqrt(in_features)  # nn.Linear's default init, on the global fan-in
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
        self._quantizers = GemmQuantizers(None)
        self._native = DenseFP8()  # the native FP8 path's weight copy
        # None: cast the weight copy at every native forward; True / False: the micro-batch protocol
        self.is_first_microbatch = None

    def reset_recipe_state(self, recipe) -> None:
        self._quantizers = GemmQuantizers(recipe)
        self._native = DenseFP8()

    @property
    def has_native_weight_copy(self) -> bool:
        """True once the native FP8 path cast this weight under the current recipe."""
        return self._native.weight_copy.casts > 0

    @property
    def quantizers(self) -> GemmQuantizers:
        return self._quantizers

    # ------------------------------------------------------------------ functional core
    def linear_forward(self, ctx: OpContext, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x @ W.T (+ bias)``; saves what :meth:`linear_backward` needs into ctx."""
        w = self.weight
        if x.shape[-1] != self.local_in_features:
            raise ValueError(f"BasicLinear expects input last dim {self.local_in_features}, got {tuple(x.shape)=}")
        if x.dtype != w.dtype:
            raise TypeError(f"BasicLinear input dtype {x.dtype} does not match weight dtype {w.dtype}")
        q = self._quantizers
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if q.active and DenseFP8.applies(self, x2):
            y = self._native_forward(ctx, x2, bias, x.shape)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
        if q.active:
            xq = fake_quantize_or_identity(x2, q.input)
            wq = fake_quantize_or_identity(w, q.weight)
        else:
            xq, wq = x2, w
        row = self._row_parallel
        if bias is not None and not row:
            y = torch.addmm(bias, xq, wq.t())
        else:
            y = torch.mm(xq, wq.t())
            if row:
                y = _comm.all_reduce_sum(y, self.tensor_parallel_group)
            if bias is not None:
                y = y + bias
        if ctx.requires_grad:
            saved_x, saved_w = (xq, wq) if q.save_quantized_operands else (x2, w)
            ctx.saved = (saved_x if w.requires_grad else None, saved_w, x.shape, w.requires_grad)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    def _native_forward(self, ctx: OpContext, x2: torch.Tensor, bias, x_shape) -> torch.Tensor:
        """The native FP8 GEMM (bias fused unless the output is all-reduced first)."""
        row = self._row_parallel
        y = self._native.forward(self, ctx, x2, None if row else bias, x_shape)
        if self.is_first_microbatch:  # the later micro-batches of this optimizer step reuse the copy
            self.is_first_microbatch = False
        if row:
            y = _comm.all_reduce_sum(y, self.tensor_parallel_group)
            if bias is not None:
                y = y + bias
        return y

    def linear_backward(self, ctx: OpContext, dy: torch.Tensor):
        """Returns ``(dx, dweight)``; dx is None when the input needs no grad."""
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
        if isinstance(ctx.saved, DenseFP8Saved):
            saved, ctx.saved = ctx.saved, ()
            dx, dw = DenseFP8.backward(self, saved, dy2.contiguous(), ctx.input_requires_grad)
            if dx is not None:
                if self._column_parallel:
                    dx = _comm.all_reduce_sum(dx, self.tensor_parallel_group)
                if len(saved.x_shape) != 2:
                    dx = dx.reshape(saved.x_shape)
            return dx, dw
        saved_x, saved_w, x_shape, weight_requires_grad = ctx.saved
        ctx.saved = ()
        q = self._quantizers.grad_output
        dyq = dy2 if q is None else fake_quantize_or_identity(dy2, q)
        dx = None
        if ctx.input_requires_grad:
            dx = torch.mm(dyq, saved_w)
            if self._column_parallel:
                dx = _comm.all_reduce_sum(dx, self.tensor_parallel_group)
            if len(x_shape) != 2:
                dx = dx.reshape(x_shape)
        dw = torch.mm(dyq.t(), saved_x) if weight_requires_grad else None
        return dx, dw

    # ------------------------------------------------------------------ op interface
    def op_forward(self, ctx, x, extra_inputs, recipe):
        return self.linear_forward(ctx, x), ()

    def op_backward(self, ctx, dy, grad_extra_outputs):
        dx, dw = self.linear_backward(ctx, dy)
        return dx, [dw], ()

    def extra_repr(self) -> str:
        tp = f", tensor_parallel_mode={self.tensor_parallel_mode!r}" if self.tensor_parallel_mode else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{tp}"
