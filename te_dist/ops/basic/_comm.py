"""Functional collectives along dim 0 / sum, with a gloo fallback.

Why a fallback: gloo (the CPU test backend) lacks ``reduce_scatter_tensor`` in some torch builds;
an all-reduce followed by taking this rank's chunk gives the same result with more traffic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...distributed.groups import group_rank, group_size, world_if_none

__all__ = ["world_size", "all_reduce_sum", "all_gather_dim0", "reduce_scatter_dim0"]


def world_size(group) -> int:
    """Ranks in ``group``, ``None`` being the default (world) group as in torch (1 without a process group)."""
    return group_size(world_if_none(group))


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    if world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    size = world_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    try:
        dist.all_gather_into_tensor(out, x, group=group)
    except (RuntimeError, NotImplementedError):
        dist.all_gather(list(out.chunk(size)), x, group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    size = world_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"reduce-scatter needs dim 0 divisible by the group size: {x.shape[0]=} {size=}")
    x = x.contiguous()
    if x.device.type == "cpu":
        # gloo: no reduce_scatter_tensor; same result via all-reduce + own chunk.
        summed = x.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        return summed.chunk(size)[group_rank(world_if_none(group))].contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group)
    return out
