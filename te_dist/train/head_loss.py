"""The LM head and the loss as one autograd step, so that the logits' gradient is written once, already in FP8.

Why: with the head on the native FP8 path under Float8CurrentScaling, the fused cross-entropy's backward writes the
[T, V] gradient of the logits in bf16 (2 bytes a logit) and the head's backward casts it to both FP8 layouts (reads
2, writes 2): at 32k tokens x 32k vocabulary ~4 GB of traffic a step that no GEMM needs. Here the loss's backward
writes the head's FP8 operand itself (te_dist.train.head_loss_triton) and the head's dgrad and wgrad take it
(``DenseFP8.backward_quantized``). A per-tensor cast needs the amax before its first byte: the forward finds max
|softmax - onehot| over the logits (``cross_entropy.forward_rows``), so the bytes are those of the bf16 gradient's
cast, bit for bit. (Float8BlockScaling's 1x128 gradient written the same way was no faster: docs/quantization.md.)

Taken where ``te_dist.settings.fp8_head_loss`` is on (the default), gradients are recorded, the
head is a BasicLinear without tensor parallelism whose native FP8 path runs for these rows (a multiple of 4), the
recipe's grad_output quantizer is current scaling without an amax group, and the fused cross-entropy runs (CUDA,
Triton). Everything else: ``cross_entropy(head(h), targets)``.
"""

from __future__ import annotations

import torch

from .. import settings
from ..autocast import get_active_recipe, get_recipe_key
from ..quantization.per_tensor import CurrentScalingQuantizer
from .cross_entropy import cross_entropy, forward_rows, fused_available

__all__ = ["lm_head_loss", "fp8_gradient_applies"]


def fp8_gradient_applies(head, h_TH: torch.Tensor) -> bool:
    """Whether :func:`lm_head_loss` takes the one-step path for ``head`` and these rows (the module doc)."""
    if not settings.current().fp8_head_loss or not torch.is_grad_enabled():
        return False
    from ..ops import BasicLinear
    from ..ops.basic.dense_fp8 import DenseFP8

    if not isinstance(head, BasicLinear) or head.tensor_parallel_size != 1 or h_TH.dim() != 2:
        return False
    recipe = get_active_recipe()
    if recipe is None or h_TH.shape[0] % 4 or not h_TH.is_cuda:
        return False
    head.ensure_recipe_state(recipe, get_recipe_key())  # what the head's own forward would do first
    grad_q = head.quantizers.grad_output
    if not isinstance(grad_q, CurrentScalingQuantizer) or grad_q.group is not None:
        return False
    return DenseFP8.applies(head, h_TH) and fused_available(h_TH)


def lm_head_loss(head, h_TH: torch.Tensor, targets_T: torch.Tensor, *, fused: bool = True) -> torch.Tensor:
    """Mean cross-entropy of ``head(h_TH)`` [T, V] against ``targets_T`` [T] (float32 scalar): the one-step FP8
    path where :func:`fp8_gradient_applies`, else :func:`~te_dist.train.cross_entropy.cross_entropy`."""
    if fused and fp8_gradient_applies(head, h_TH):
        return _HeadLossFP8.apply(h_TH, head.weight, targets_T.contiguous(), head)
    return cross_entropy(head(h_TH), targets_T, fused=fused)


class _HeadLossFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TH, weight, targets_T, head):
        from ..ops.basic.dense_fp8 import DenseFP8Saved
        from ..ops.op import OpContext

        op_ctx = OpContext(head, True, head.quantizers.recipe)
        logits_TV = head.linear_forward(op_ctx, h_TH)
        if not isinstance(op_ctx.saved, DenseFP8Saved):  # fp8_gradient_applies said it would run natively
            raise RuntimeError("the LM head did not run its native FP8 forward")
        dmax_bits = torch.zeros(1, dtype=torch.int32, device=logits_TV.device)  # the gradient's amax, found here
        loss_T, lse_T = forward_rows(logits_TV, targets_T, dmax_bits)
        ctx.save_for_backward(logits_TV, targets_T, lse_T, dmax_bits)
        ctx.head, ctx.dense = head, op_ctx.saved
        return loss_T.sum() / loss_T.shape[0]

    @staticmethod
    def backward(ctx, grad):
        from ..ops.basic.dense_fp8 import DenseFP8
        from ..quantization.tensors import Float8Tensor
        from .head_loss_triton import cross_entropy_grad_fp8

        logits_TV, targets_T, lse_T, dmax_bits = ctx.saved_tensors
        head, dense = ctx.head, ctx.dense
        ctx.head = ctx.dense = None
        q = head.quantizers.grad_output
        data, data_t, scale_inv = cross_entropy_grad_fp8(logits_TV, targets_T, lse_T, grad, dmax_bits, q.fp8_dtype,
                                                         q.fmt_max, q.use_power_2_scales)
        dyq = Float8Tensor(data, scale_inv, q.fmt, logits_TV.dtype, data_t=data_t)
        dx, dw = DenseFP8.backward_quantized(head, dense, dyq, ctx.needs_input_grad[0], head.weight.dtype)
        return dx, dw, None, None
