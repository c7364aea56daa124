"""Expert-parallel (EP) and expert-data-parallel (EDP) process groups.

Why contiguous EP blocks: ranks ``[k*ep, (k+1)*ep)`` form one EP group, so on a node the
all-to-all stays on NVLink when ``ep_size`` divides the GPUs per node. The EDP group of a rank
holds the ranks with the same position in every EP block: they hold the same experts and are
the ranks a data-parallel wrapper reduces expert gradients over.

    world 8, ep_size 4:  EP groups  [0 1 2 3] [4 5 6 7]
                         EDP groups [0 4] [1 5] [2 6] [3 7]

``group=None`` everywhere means "no expert parallelism" (a group of one), so single-process
code never needs ``torch.distributed`` to be initialised.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .bounded import check_timeout_s, group_timeout_s

__all__ = [
    "ExpertParallelGroups",
    "init_expert_parallel_groups",
    "group_rank",
    "group_size",
    "world_if_none",
]


def group_size(group) -> int:
    """Number of ranks in ``group``; 1 for ``None`` (no parallelism)."""
    if group is None:
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index inside ``group``; 0 for ``None``."""
    if group is None:
        return 0
    return dist.get_rank(group)


def world_if_none(group):
    """``group``, or the world group for ``None`` once torch.distributed is initialised.

    Why: the comm ops (``td.ops.AllGather(group=None)``, tensor-parallel linears) keep torch's
    convention, where ``None`` is the default group; te_dist's own ``None`` means no parallelism.
    Callers with torch's convention resolve the group here, then use the helpers above.
    """
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


@dataclass(frozen=True)
class ExpertParallelGroups:
    """The groups one rank belongs to, plus the rank lists they were built from (for logs/docs)."""

    ep_group: Optional[object]
    edp_group: Optional[object]
    ep_ranks: tuple
    edp_ranks: tuple

    @property
    def ep_size(self) -> int:
        return len(self.ep_ranks)

    @property
    def edp_size(self) -> int:
        return len(self.edp_ranks)


def _layout(world_size: int, ep_size: int):
    """Pure rank arithmetic: (list of EP rank lists, list of EDP rank lists)."""
    ep_blocks = [list(range(start, start + ep_size)) for start in range(0, world_size, ep_size)]
    edp_lists = [list(range(pos, world_size, ep_size)) for pos in range(ep_size)]
    return ep_blocks, edp_lists


def init_expert_parallel_groups(ep_size: int, *, backend: Optional[str] = None,
                                timeout_s: Optional[float] = None) -> ExpertParallelGroups:
    """Create every EP and EDP group (collective: all ranks must call it with the same ``ep_size``).

    ``torch.distributed.new_group`` must be entered by every rank for every group, in the same
    order, even for groups a rank is not in; that is why all groups are built here at once.
    Groups of size one are returned as ``None`` when the world is a single process.
    ``timeout_s`` (default: the default group's timeout, not torch's 30 min for a new group) bounds
    every collective on these groups (te_dist.distributed.bounded).
    """
    if not isinstance(ep_size, int) or isinstance(ep_size, bool):
        raise TypeError(f"ep_size must be an int, got {type(ep_size).__name__}")
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size=}")
    if not dist.is_available() or not dist.is_initialized():
        if ep_size != 1:
            raise ValueError(f"{ep_size=} needs torch.distributed to be initialised (world size 1 allows only 1)")
        return ExpertParallelGroups(None, None, (0,), (0,))
    timeout_s = check_timeout_s(timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else group_timeout_s(None))
    world_size = dist.get_world_size()
    if world_size % ep_size != 0:
        raise ValueError(f"world size {world_size} is not divisible by {ep_size=}")
    rank = dist.get_rank()
    ep_blocks, edp_lists = _layout(world_size, ep_size)
    my_ep = my_edp = None
    for ranks in ep_blocks:
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            my_ep = (g, tuple(ranks))
    for ranks in edp_lists:
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            my_edp = (g, tuple(ranks))
    assert my_ep is not None and my_edp is not None
    return ExpertParallelGroups(my_ep[0], my_edp[0], my_ep[1], my_edp[1])
