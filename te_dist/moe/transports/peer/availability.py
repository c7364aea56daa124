"""Whether the peer transport can run for an EP group, agreed by every rank of the group.

Why agreed: a rank that moved rows through peer memory while another used the all-to-all would
wait in a barrier the other never enters. The reasons that are the same on every rank (the
group's backend, the row width from the layer's config) are checked locally; the ones that may
differ (the host, symmetric memory in this torch, nvcc to build the kernels) are gathered once
per (group, device) with one ``all_gather_object`` and cached.
"""

from __future__ import annotations

import importlib
import socket
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from ....distributed.groups import group_size

__all__ = ["use_peer_rows", "forget_agreements"]

_agreed: Dict[Tuple[str, object], List[str]] = {}  # (group, device index) -> why not, per rank; empty: peer runs


def _local_support(device: torch.device) -> str:
    """'' when this rank can use peer rows, else why not."""
    if device.type != "cuda":
        return f"tensors on {device}"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
        from .library import load_peer_rows

        load_peer_rows()
    except Exception as exc:  # no symmetric memory in this torch, or no nvcc to build the kernels
        return f"{type(exc).__name__}: {exc}"
    return ""


def _same_everywhere(group, row_bytes: int) -> List[str]:
    """Reasons against peer rows that every rank derives alike (no collective needed)."""
    backend = dist.get_backend(group)
    return [why for bad, why in (
        (backend != "nccl", f"the EP group runs {backend}, not nccl"),
        (row_bytes % 16 != 0, f"rows of {row_bytes} bytes (a multiple of 16 is needed)"),
    ) if bad]


def _agree(group, device: torch.device) -> List[str]:
    """Every rank's reasons against peer rows; collective on the first call per (group, device)."""
    g = group if group is not None else dist.group.WORLD
    key = (g.group_name, device.index)
    why = _agreed.get(key)
    if why is None:
        mine = (socket.gethostname(), _local_support(device))
        everyone: List = [None] * group_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        hosts = {h for h, _ in everyone}
        why = [f"rank {r}: {w}" for r, (_, w) in enumerate(everyone) if w]
        if len(hosts) > 1:
            why.append(f"ranks on {len(hosts)} hosts")
        _agreed[key] = why
    return why


def forget_agreements() -> None:
    """Drop every cached agreement (the process groups they were made in are gone: a new group may
    reuse a name)."""
    _agreed.clear()


def use_peer_rows(group, device: torch.device, row_bytes: int, *, required: bool = False, source: str = "") -> bool:
    """Whether the EP group (of more than one rank) moves rows of ``row_bytes`` bytes through peer
    memory. ``required`` (the transport was forced; ``source`` says where): raise with the reasons
    instead of answering False. Every rank must call it with the same arguments (the layer's config)."""
    unfit = _same_everywhere(group, row_bytes)
    if unfit:
        if required:
            raise ValueError(f"{source} but peer rows cannot run: {'; '.join(unfit)}")
        return False
    why = _agree(group, device)
    if why and required:
        raise RuntimeError(f"{source} but peer rows are unavailable: {'; '.join(why)}")
    return not why
