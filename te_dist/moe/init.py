"""Expert-parallel-invariant initialisation of stacked expert weights.

Why: a layer built at EP=1 and one built at EP=N after the same ``torch.manual_seed(s)`` must
compute the same function. Drawing the experts from the global generator would make expert e's
values depend on how many experts this rank builds before it. Instead each global expert gets
its own generator, seeded from one base seed (drawn once from the global generator, the same
draw at every EP size) and from (e, tensor slot).
"""

from __future__ import annotations

import math

import torch

__all__ = ["draw_base_seed", "expert_seed", "init_expert_slice_"]

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
