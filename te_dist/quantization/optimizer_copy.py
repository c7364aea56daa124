"""Which weight quantizers an optimizer's update can write the copy for, and that update (te_dist.optim).

Why here: what the copy is (its bytes, scales and the quantizer state it moves) belongs to the quantizers; the
optimizer only hands over a parameter, its gradient, its moments and AdamW's settings. Two recipes qualify:
DelayedScaling, whose scale is known before the update (the fused step's one-program roll follows, as after the
forward's cast), unless its amax is reduced over a group or by a callable; and Float8BlockScaling's 128x128 weight
blocks, each block's scale its own. The kernels: :mod:`.triton_adamw_copy` (Triton; imported on first use).
"""

from __future__ import annotations

import torch

from ..recipe import DelayedScaling, Float8BlockScaling
from .fused import fused_casts_for
from .tensors import BlockScaledData, Float8BlockTensor, Float8Tensor, QuantizedTensor

__all__ = ["writes_copy", "copy_kernels_for", "adamw_step_with_copy"]


def writes_copy(quantizer) -> bool:
    """True for a weight quantizer whose cast an optimizer's update can make (module docstring)."""
    kind = getattr(quantizer, "recipe_type", None)
    if kind is DelayedScaling:
        return quantizer.num_updates > 0 and quantizer._fusable()
    return kind is Float8BlockScaling and quantizer.block_shape == (128, 128)


def copy_kernels_for(p: torch.Tensor):
    """The kernel module for parameter ``p`` (on a device the Triton casts run on), or None."""
    return fused_casts_for(p, "adamw_copy")


def adamw_step_with_copy(quantizer, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float,
                         beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> QuantizedTensor:
    """AdamW's step ``step`` of ``p`` [E, N, K] (from ``p.grad``; the moments updated in place) and ``quantizer``'s
    copy of the result in both layouts, the quantizer's state moved as its cast moves it."""
    kernels = copy_kernels_for(p)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    if quantizer.recipe_type is DelayedScaling:
        quantizer._to_device(p.device)
        scale_inv = quantizer.scale_inv
        data, data_t, history, scale, new_scale_inv = kernels.adamw_delayed_copy(
            p, p.grad, exp_avg, exp_avg_sq, **hyper, scale=quantizer.scale, history=quantizer.amax_history,
            fp8_dtype=quantizer.fp8_dtype, fmt_max=quantizer.fmt_max, margin=quantizer.margin,
            algo=quantizer.amax_compute_algo)
        quantizer.amax_history, quantizer.scale, quantizer.scale_inv = history, scale, new_scale_inv
        quantizer.num_updates += 1
        return Float8Tensor(data, scale_inv, quantizer.fmt, p.dtype, data_t=data_t)
    data, scale_inv, data_t, scale_inv_t = kernels.adamw_block_copy(
        p, p.grad, exp_avg, exp_avg_sq, **hyper, fp8_dtype=quantizer.fp8_dtype, fmt_max=quantizer.fmt_max,
        power_2=quantizer.use_power_2_scales)
    return Float8BlockTensor(p.shape, p.dtype, quantizer.fmt, BlockScaledData(data, scale_inv, 128, 128),
                             BlockScaledData(data_t, scale_inv_t, 128, 128, transposed=True))
