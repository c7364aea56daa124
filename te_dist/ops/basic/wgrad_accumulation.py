"""Where a GroupedLinear's native FP8 wgrad adds itself into the weight's gradient, and what autograd gets then.

``GroupedLinear.fuse_wgrad_accumulation`` (TransformerEngine's name; Megatron's ``gradient_accumulation_fusion``,
while ``te_dist.settings.megatron_main_grad_fusion`` is on) is the caller's word that the wgrad may go into the
gradient directly:

- a weight with ``main_grad`` (Megatron's DDP buffer, float32 or the weight's dtype): the wgrad adds into it and
  marks the weight ``grad_added_to_main_grad``; autograd gets a placeholder (the DDP hook asserts a ``.grad`` under
  overlap_grad_reduce, then skips its own add);
- else a weight with a ``.grad`` already (a later micro-batch; nothing may hook the accumulation, as torch DDP
  does): the wgrad adds into it in place, as autograd would; autograd gets nothing.

Elsewhere (the first micro-batch, autograd.grad, ``create_graph``, a gradient of another layout, zero padded
features) the wgrad goes to autograd as usual. The add runs in the GEMM's epilogue where
``te_dist.settings.fp8_wgrad_accumulation`` is on (the accumulating kernels), else right after it (the bits the hook's
or autograd's own add gives).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["accumulator", "added_into", "not_added_yet", "set_fuse_wgrad_accumulation"]


def accumulator(weight: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient the wgrad of ``weight`` adds into itself (the module doc's list), or None: autograd adds. The
    caller has checked its own conditions (the attribute set, features not padded)."""
    if torch.is_grad_enabled():  # create_graph: autograd's add is out of place
        return None
    grad = getattr(weight, "main_grad", None)
    dtypes = (weight.dtype, torch.float32) if grad is not None else (weight.dtype,)
    grad = weight.grad if grad is None else grad
    if type(grad) is not torch.Tensor or grad.shape != weight.shape or grad.dtype not in dtypes or \
            not grad.is_contiguous():
        return None
    try:  # a backward that adds nothing into .grad (autograd.grad, backward(inputs=...) without the weight)
        edge = torch.autograd.graph.get_gradient_edge(weight)
        return grad if torch._C._will_engine_execute_node(edge.node) else None
    except (AttributeError, RuntimeError):  # autograd.grad of the weight itself: its result is returned
        return None


def added_into(weight: torch.nn.Parameter, grad: torch.Tensor) -> Optional[torch.Tensor]:
    """What autograd gets for ``weight`` once its wgrad went into ``grad`` (``accumulator``'s answer)."""
    if grad is weight.grad:
        return None
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)


def not_added_yet(weight: torch.nn.Parameter) -> None:
    """Clear the mark an earlier micro-batch's add into ``main_grad`` left: this backward's wgrad goes to autograd
    (and Megatron's hook adds it) unless this backward adds it itself."""
    if getattr(weight, "grad_added_to_main_grad", False):
        weight.grad_added_to_main_grad = False


def set_fuse_wgrad_accumulation(model: torch.nn.Module, on: bool) -> None:
    """Set ``fuse_wgrad_accumulation`` on every module of ``model`` that has it (the expert GroupedLinears), as
    ``set_first_microbatch`` sets its flag: the caller's word for the whole model."""
    for op in model.modules():
        if hasattr(op, "fuse_wgrad_accumulation"):
            op.fuse_wgrad_accumulation = on
