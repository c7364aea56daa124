"""Expert-parallel-invariant initialisation of stacked expert weights (MoELayer and the Megatron experts).

Why: a layer built at EP=1 and one built at EP=N after the same ``torch.manual_seed(s)`` must
compute the same function. Drawing the experts from the global generator would make expert e's
values depend on how many experts this rank builds before it. Instead each global expert's
tensors are drawn from a seed of (base seed, e, tensor slot), the base seed being the same at
every EP size. :func:`init_experts_` is the one loop; what fills a slice is the caller's:
``MoELayer`` draws nn.Linear's default from a private generator (:func:`uniform_fan_in`), the
Megatron experts run Megatron's ``init_method`` on the seeded global generator
(:func:`on_seeded_global_rng`).

Slots: 0 fc1.weight, 1 fc1.bias, 2 fc2.weight, 3 fc2.bias.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple

import torch

__all__ = ["draw_base_seed", "expert_seed", "init_expert_slice_", "init_experts_", "uniform_fan_in",
           "on_seeded_global_rng"]

SliceInit = Callable[[torch.Tensor, int], None]  # (one expert's slice, its seed) -> fills the slice

_MASK = (1 << 63) - 1


def draw_base_seed() -> int:
    """One draw from the global CPU generator (identical at every EP size for the same seed)."""
    return int(torch.randint(0, 1 << 62, (1,), dtype=torch.int64).item())


def expert_seed(base_seed: int, global_expert: int, slot: int) -> int:
    """A generator seed for (expert, tensor slot); splitmix64-style mixing keeps seeds apart."""
    z = (base_seed + 0x9E3779B97F4A7C15 * (global_expert * 8 + slot + 1)) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK


@torch.no_grad()
def init_expert_slice_(param_slice: torch.Tensor, fan_in: int, seed: int) -> None:
    """``uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (nn.Linear's default) from a private generator.

    Values are drawn in fp32 on the parameter's device (CUDA generators are deterministic per
    seed and shape too), then cast, so the dtype of the layer does not change the draw.
    """
    gen = torch.Generator(device=param_slice.device).manual_seed(seed)
    bound = 1.0 / math.sqrt(fan_in)
    values = torch.empty(param_slice.shape, dtype=torch.float32, device=param_slice.device)
    values.uniform_(-bound, bound, generator=gen)
    param_slice.copy_(values)


def uniform_fan_in(fan_in: int) -> SliceInit:
    """nn.Linear's default init of a slice (:func:`init_expert_slice_`)."""
    return lambda param_slice, seed: init_expert_slice_(param_slice, fan_in, seed)


def on_seeded_global_rng(init_method: Callable[[torch.Tensor], object]) -> SliceInit:
    """``init_method(slice)`` (e.g. Megatron's, which draws from the global generators) with the
    global CPU and CUDA generators seeded for the slice, restored afterwards."""

    def init(param_slice: torch.Tensor, seed: int) -> None:
        devices = [param_slice.device] if param_slice.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            init_method(param_slice)

    return init


@torch.no_grad()
def init_experts_(slots: Sequence[Tuple[Optional[torch.Tensor], SliceInit]], first_expert: int,
                  base_seed: int) -> None:
    """Fill stacked expert tensors ``[El, ...]`` slice by slice: slice i of slot s gets
    ``init(slice, expert_seed(base_seed, first_expert + i, s))``; a None tensor is skipped."""
    for slot, (tensor, init) in enumerate(slots):
        if tensor is None:
            continue
        for i in range(tensor.shape[0]):
            init(tensor[i], expert_seed(base_seed, first_expert + i, slot))
