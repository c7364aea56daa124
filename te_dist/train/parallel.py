"""Process-group setup for a training rank, and the gradient reduction of an EP x DP layout.

Every rank is a data-parallel rank for the dense weights (embedding, attention, norms, router,
head: replicated everywhere) and an expert-parallel rank inside its EP group for the expert
weights (each EP rank holds ``num_experts / ep`` experts, replicated over its EDP group).

Why gradients are divided by the WORLD size for both kinds: the training loss is the mean of
the ranks' local mean losses, ``L = (1/W) sum_r L_r``. A dense weight's gradient is the sum of
the ranks' gradients over W; an expert weight already receives, through the all-to-all
backward, the gradients of every token of its EP group, so summing over its EDP replicas gives
``sum_r dL_r/dW`` and the same division by W gives ``dL/dW``. Both therefore match one rank
training on the whole global batch, whatever the EP size.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.bounded import wait_collective

__all__ = ["Runtime", "init_runtime", "expert_parameter_names", "GradientReducer", "global_expert_ids", "dense_group"]


@dataclass
class Runtime:
    """Where this rank runs: its rank numbers, device, backend and EP/EDP groups."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    groups: object  # te_dist.distributed.groups.ExpertParallelGroups
    checkpoint_group: object = None  # gloo, every rank, timeout train.checkpoint_timeout_s (None: the default group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ep_size(self) -> int:
        return self.groups.ep_size

    @property
    def ep_rank(self) -> int:
        return self.groups.ep_ranks.index(self.rank)


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("train.device='cuda' was asked for, but torch.cuda.is_available() is False")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(f"local rank {local_rank} has no GPU: only {count} visible; use --nproc {count} or fewer")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_runtime(*, device: str, ep_size: int, timeout_s: float = 300.0, startup_timeout_s: Optional[float] = None,
                 checkpoint_timeout_s: Optional[float] = None) -> Runtime:
    """Join the torchrun job (env:// rendezvous) and build the EP/EDP groups.

    ``timeout_s`` bounds every collective of the job on all its groups (te_dist.distributed.bounded).
    ``startup_timeout_s`` (default ``timeout_s``) bounds the rendezvous: the default group is created
    with it (a peer may still be importing torch), then set to ``timeout_s`` for the collectives.
    ``checkpoint_timeout_s``: a gloo group of every rank with this timeout carries the checkpoint
    saves' coordination (a rank's shard may take longer to write than a step's collective may
    wait; gloo on every device, as DCP's CPU coordination is). Runs as world size 1 without
    torchrun too (a plain ``python -m te_dist.train.worker``).
    """
    from ..distributed.groups import init_expert_parallel_groups

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # not started by torchrun: a one-rank job on a private port
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        joining_s = startup_timeout_s if startup_timeout_s is not None else timeout_s
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=joining_s), **kwargs)
        if joining_s != timeout_s:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))
    groups = init_expert_parallel_groups(ep_size, timeout_s=timeout_s)
    checkpoint_group = None
    if checkpoint_timeout_s is not None:
        checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=checkpoint_timeout_s))
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend, groups, checkpoint_group)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_expert_module(module: nn.Module) -> bool:
    try:
        from ..ops import GroupedLinear
    except ImportError:  # ops not importable: fall back to explicit parameter marks only
        return False
    return isinstance(module, GroupedLinear)


def expert_parameter_names(model: nn.Module) -> list:
    """Names of the expert-sharded parameters (first dim = local experts).

    A parameter is an expert parameter when it belongs to a GroupedLinear op (weights
    [E_local, out, in], biases [E_local, out]) or carries the Megatron-Core marker
    ``allreduce = False`` that MoELayer sets on its expert weights.
    """
    names = []
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if _is_expert_module(module) or getattr(p, "allreduce", True) is False:
                names.append(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


def global_expert_ids(num_local: int, ep_rank: int) -> range:
    """Global expert ids of this EP rank: contiguous blocks, rank k holds [k*E_local, (k+1)*E_local)."""
    return range(ep_rank * num_local, (ep_rank + 1) * num_local)


class GradientReducer:
    """One flat all-reduce for the dense gradients (WORLD), one for the expert ones (EDP)."""

    def __init__(self, model: nn.Module, runtime: Runtime):
        expert = set(expert_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.dense = [p for n, p in named if n not in expert]
        self.expert = [p for n, p in named if n in expert]
        self.runtime = runtime

    def _reduce(self, params: Iterable[nn.Parameter], group, group_size: int, kind: str) -> None:
        params = list(params)
        if not params:
            return
        for p in params:
            if p.grad is None:  # e.g. an expert that received no token: still take part, with zeros
                p.grad = torch.zeros_like(p)
        scale = 1.0 / self.runtime.world_size
        if group_size == 1:
            if scale != 1.0:  # one rank: a pass over every gradient that would change nothing
                for p in params:
                    p.grad.mul_(scale)
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # one collective, not one per tensor
        wait_collective(dist.all_reduce(flat, group=group, async_op=True), f"{kind} gradient all-reduce", group)
        flat.mul_(scale)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def reduce(self) -> None:
        rt = self.runtime
        self._reduce(self.dense, None, rt.world_size, "dense")
        self._reduce(self.expert, rt.groups.edp_group, rt.groups.edp_size, "expert")

    def squared_norms(self) -> torch.Tensor:
        """fp32 [2]: (dense, expert) sums of squared gradient entries on this rank, after :meth:`reduce`.

        The global gradient norm is ``sqrt(dense + sum_over_WORLD(expert) / edp_size)``: dense
        gradients are the same on every rank, each expert's lives on its EP rank and its EDP replicas.
        """
        out = []
        for params in (self.dense, self.expert):
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                out.append(torch.zeros((), dtype=torch.float32, device=self.runtime.device))
                continue
            out.append(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum())
        return torch.stack(out)


def dense_group() -> Optional[object]:
    """The group every rank agrees on the recipe over (the whole job)."""
    return dist.group.WORLD if dist.is_initialized() else None
