"""Checkpointing of recipe state: the quantizers' amax histories and scales (DelayedScaling).

Why: a delayed-scaling quantizer scales today's tensor with yesterday's amax history; a resumed
run that started from fresh quantizers would quantize its first steps differently and drift
from the uninterrupted run. The state is per rank (each rank observes its own tensors), so it
is restored only when the job has the same number of ranks and EP size; otherwise the
quantizers start fresh and the run says so.

Ops build their quantizers lazily on the first call under a recipe; :func:`prepare` builds them
up front with the same key the fuser will use, so restored state is not thrown away.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

__all__ = ["prepare", "state_dict", "load_state_dict"]

_ROLES = ("input", "weight", "grad_output")


def _quantizers(model: nn.Module) -> Iterator[tuple]:
    for mod_name, module in model.named_modules():
        gemm = getattr(module, "quantizers", None)
        if gemm is None or not hasattr(module, "ensure_recipe_state"):
            continue
        for role in _ROLES:
            q = getattr(gemm, role, None)
            if q is not None:
                yield f"{mod_name}/{role}", q


def _fields(q) -> dict:
    """The quantizer's mutable numeric state: its tensors and its update counter."""
    out = {k: v for k, v in vars(q).items() if isinstance(v, torch.Tensor)}
    if isinstance(getattr(q, "num_updates", None), int):
        out["num_updates"] = torch.tensor(q.num_updates, dtype=torch.int64)
    return out


def prepare(model: nn.Module, recipe, key) -> None:
    """Build every op's recipe state for ``recipe`` now (keyed like the fuser keys it)."""
    for module in model.modules():
        ensure = getattr(module, "ensure_recipe_state", None)
        if ensure is not None:
            ensure(recipe, key)


def state_dict(model: nn.Module, prefix: str) -> dict:
    return {f"{prefix}/{name}/{field}": value.detach().clone()
            for name, q in _quantizers(model) for field, value in _fields(q).items()}


def load_state_dict(model: nn.Module, state: dict, prefix: str) -> None:
    for name, q in _quantizers(model):
        for field, current in _fields(q).items():
            value = state[f"{prefix}/{name}/{field}"]
            if field == "num_updates" and not isinstance(getattr(q, field), torch.Tensor):
                setattr(q, field, int(value))
            else:
                setattr(q, field, value.to(device=current.device, dtype=current.dtype).clone())
