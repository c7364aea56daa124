"""Which weight quantizers an optimizer's update can write the copy for, and that update (te_dist.optim).

Why here: what the copy is (its bytes, scales and the quantizer state it moves) belongs to the quantizers; the
optimizer only hands over a parameter, its gradient, its moments and AdamW's settings. The recipes: DelayedScaling,
whose scale is known before the update (the fused step's one-program roll follows, as after the forward's cast;
"max" or "most_recent" only); Float8BlockScaling's 128x128 weight blocks, each block's scale its own (for features
off the 128 grid, under ``te_dist.settings.fp8_optimizer_copies_padded``, the copy of the zero padded weight); and,
under ``te_dist.settings.fp8_optimizer_copies_current``, Float8CurrentScaling, whose update records the amax and
whose cast then reads the weight once more. A per-tensor amax that an all-reduce would merge (a group of more than
one rank) stays with the forward's cast: a collective inside the optimizer's step would hang the ranks whose ops
said otherwise. The kernels: :mod:`.triton_adamw_copy` (Triton; imported on first use).
"""

from __future__ import annotations

import torch

from .. import settings
from ..recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from .fused import fused_casts_for
from .tensors import BlockScaledData, Float8BlockTensor, Float8Tensor, QuantizedTensor

__all__ = ["writes_copy", "copy_kernels_for", "adamw_step_with_copy"]


def writes_copy(quantizer, padded: bool = False) -> bool:
    """True for a weight quantizer whose cast an optimizer's update can make (module docstring); ``padded``: the
    cast of the weight zero padded to the 128 grid (off-grid features), which only the block copy writes."""
    kind = getattr(quantizer, "recipe_type", None)
    if padded:
        return kind is Float8BlockScaling and quantizer.block_shape == (128, 128) and \
            settings.current().fp8_optimizer_copies_padded
    if kind is DelayedScaling:
        return quantizer.num_updates > 0 and quantizer.amax_compute_algo in ("max", "most_recent") and \
            _reduces_nothing(quantizer)
    if kind is Float8CurrentScaling:
        return settings.current().fp8_optimizer_copies_current and _reduces_nothing(quantizer)
    return kind is Float8BlockScaling and quantizer.block_shape == (128, 128)


def _reduces_nothing(quantizer) -> bool:
    """No amax all-reduce runs for this quantizer's casts: no group (or no reduction asked), or a one-rank group."""
    group = quantizer.group
    if group is None or not getattr(quantizer, "reduce_amax", True):
        return True
    import torch.distributed as dist  # lazy: only distributed runs pay for it

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) <= 1


def copy_kernels_for(p: torch.Tensor):
    """The kernel module for parameter ``p`` (on a device the Triton casts run on), or None."""
    return fused_casts_for(p, "adamw_copy")


def adamw_step_with_copy(quantizer, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float,
                         beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> QuantizedTensor:
    """AdamW's step ``step`` of ``p`` [E, N, K] (from ``p.grad``; the moments updated in place) and ``quantizer``'s
    copy of the result in both layouts, the quantizer's state moved as its cast moves it (block scaling: of the
    result zero padded to the 128 grid, where N or K is off it)."""
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
    if quantizer.recipe_type is Float8CurrentScaling:
        data, data_t, scale_inv = kernels.adamw_current_copy(
            p, p.grad, exp_avg, exp_avg_sq, **hyper, fp8_dtype=quantizer.fp8_dtype, fmt_max=quantizer.fmt_max,
            power_2=quantizer.use_power_2_scales)
        return Float8Tensor(data, scale_inv, quantizer.fmt, p.dtype, data_t=data_t)
    data, scale_inv, data_t, scale_inv_t = kernels.adamw_block_copy(
        p, p.grad, exp_avg, exp_avg_sq, **hyper, fp8_dtype=quantizer.fp8_dtype, fmt_max=quantizer.fmt_max,
        power_2=quantizer.use_power_2_scales)
    return Float8BlockTensor(data.shape, p.dtype, quantizer.fmt, BlockScaledData(data, scale_inv, 128, 128),
                             BlockScaledData(data_t, scale_inv_t, 128, 128, transposed=True))
