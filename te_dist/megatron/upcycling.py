"""Dense → MoE upcycling into te_dist's experts, with Megatron-Core's own conversion.

Why: Megatron's ``upcycling_utils`` (``--moe-use-upcycling``) converts a dense checkpoint into an MoE
model, but accepts only SequentialMLP and TEGroupedMLP experts (a TypeError for any other). These
functions take the same arguments and run Megatron's conversion unchanged: while it runs, every
``GroupedExperts`` of the model is replaced by an empty module of SequentialMLP's type, so Megatron
writes SequentialMLP's per-expert keys, which ``GroupedExperts.load_state_dict`` accepts
(``te_dist.megatron.state_dict``). The result equals Megatron's upcycling into SequentialMLP, weight
for weight; Megatron's files are not patched.

    # in place of megatron.core.transformer.moe.upcycling_utils.load_and_upcycle_model:
    from te_dist.megatron.upcycling import load_and_upcycle_model
    load_and_upcycle_model(load_checkpoint, moe_model, dense_model, load_kwargs={...})
"""

from __future__ import annotations

import contextlib

import torch

from ._compat import require_megatron
from .experts import GroupedExperts

require_megatron()

from megatron.core.transformer.moe import upcycling_utils  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402

__all__ = ["upcycle_state_dict", "load_and_upcycle_model"]


def _sequential_mlp_stand_in() -> SequentialMLP:
    """An empty module of SequentialMLP's type: what Megatron's conversion checks, holding no weights."""
    stand_in = SequentialMLP.__new__(SequentialMLP)
    torch.nn.Module.__init__(stand_in)
    return stand_in


@contextlib.contextmanager
def _experts_shown_as_sequential_mlp(model_chunks):
    """Within the block, every GroupedExperts child of the chunks is a SequentialMLP stand-in."""
    swapped = []
    try:
        for chunk in model_chunks:
            for parent in list(chunk.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, GroupedExperts):
                        setattr(parent, name, _sequential_mlp_stand_in())
                        swapped.append((parent, name, child))
        yield
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)


def upcycle_state_dict(moe_model: list, dense_model: list) -> dict:
    """Megatron's ``upcycle_state_dict`` for models whose MoE layers may hold te_dist's experts.

    ``moe_model`` / ``dense_model``: lists of model chunks without DDP/Float16 wrappers, as Megatron's
    takes them. Returns ``{"model": state_dict}`` (``"model{i}"`` per chunk) in SequentialMLP's expert
    layout, which the chunks' ``load_state_dict`` loads.
    """
    if not isinstance(moe_model, (list, tuple)) or not isinstance(dense_model, (list, tuple)):
        raise TypeError(
            f"moe_model and dense_model must be lists of model chunks, got {type(moe_model).__name__} and "
            f"{type(dense_model).__name__}"
        )
    with _experts_shown_as_sequential_mlp(moe_model):
        return upcycling_utils.upcycle_state_dict(list(moe_model), list(dense_model))


def load_and_upcycle_model(load_dense_ckpt_func, moe_model, dense_model, strict=True, load_args=(),
                           load_kwargs=None):
    """Megatron's ``load_and_upcycle_model`` (same arguments and return value) for te_dist's experts:
    load the dense checkpoint with ``load_dense_ckpt_func``, convert, load into ``moe_model``."""
    iteration, num_floating_point_operations_so_far = load_dense_ckpt_func(*load_args, **(load_kwargs or {}))
    state_dict = upcycle_state_dict(moe_model, dense_model)
    for index, chunk in enumerate(moe_model):
        chunk.load_state_dict(state_dict["model" if len(moe_model) == 1 else f"model{index}"], strict=strict)
    return iteration, num_floating_point_operations_so_far
