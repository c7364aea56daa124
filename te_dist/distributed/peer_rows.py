"""Expert-parallel row moves through peer-mapped memory, with no host read before the token move.

Why: NCCL's variable-split all-to-all takes its split sizes on the host. The dispatch must then
read the exchanged counts first, and the GPU idles from that read until the host has launched the
token move (docs/moe.md "The host read"). Here, for the GPUs of one host, every step runs on the
device:

    dispatch (exchange_and_push, then receive_rows)
      barrier | put my counts [E] into row `me` of every rank's counts region | barrier
      plan kernel: every row's destination from the count matrix [R, E]
      async copy of the count matrix to the host | push my rows into the peers' rows regions | barrier
      host: wait for the count matrix only (the push is still running), size what follows
      copy the received rows out of the rows region (they arrive grouped by local expert, source
      rank: the order of the grouped GEMMs, so no sort follows)
    combine (send_back): barrier | copy expert outputs into my rows region | barrier | pull my rows
    backward: dispatch's is combine's forward, and combine's is dispatch's push.

Each barrier runs torch's symmetric-memory barrier protocol on the buffer's signal pads, in our own
kernel (system-scope release/acquire; a rank that waits 10 minutes traps). The one before a move
also guarantees that every rank finished reading what the previous move left in its region.
Every rank runs the same sequence of moves (like any collective), so one workspace per (EP group,
device) serves every MoE layer.

Workspace: one symmetric buffer, [counts region R x E int64 | rows region]. It grows, collectively,
when a dispatch would overflow it: the plan kernel then moves nothing, every rank sees the same
count matrix and so the same overflow, and all of them grow the buffer and push again. The first
dispatch always does this (the workspace starts with no rows region).

The row moves are ``cutlass_kernels/peer_rows.cu`` (one warp per row, 16-byte vectors). The whole
device sequence of a dispatch is queued by one host call: at small token counts the host work of a
dispatch set its speed (docs/benchmarks.md, "MoE layer", eleventh session).
"""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .groups import group_rank, group_size

__all__ = [
    "TRANSPORT_ENV",
    "PeerWorkspace",
    "RowPlan",
    "peer_workspace",
    "exchange_and_push",
    "receive_rows",
    "send_back",
    "expected_layout",
]

TRANSPORT_ENV = "TE_DIST_EP_TRANSPORT"  # "auto" (default), "peer" or "nccl"; the same on every rank
_ALIGN = 2 << 20  # rows region sizes round up to 2 MiB
_GROWTH = 1.25  # headroom when the rows region grows
_MAX_BLOCKS_PER_SM = 4
_BARRIER_TIMEOUT_NS = 600 * 10**9  # a rank that never arrives traps the kernel (an error, not a hang)
_MAX_EXPERTS = 3072  # the plan kernel keeps two int64 per expert in 48 KiB of shared memory


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class PeerWorkspace:
    """The symmetric buffer of one EP group on one device, and the device tables of peer addresses."""

    def __init__(self, group, device: torch.device):
        from cutlass_kernels.peer_rows import load_peer_rows

        self.group = group if group is not None else dist.group.WORLD
        self.world = group_size(group)
        self.rank = group_rank(group)
        self.device = device
        self.lib = load_peer_rows()
        self.num_experts = 0
        self.rows_bytes = 0
        self.buffer = None
        self.handle = None
        props = torch.cuda.get_device_properties(device)
        self.max_blocks = props.multi_processor_count * _MAX_BLOCKS_PER_SM

    # ---------------------------------------------------------------- buffer
    @property
    def counts_bytes(self) -> int:
        return _round_up(self.world * self.num_experts * 8, 256)

    def ensure(self, num_experts: int, rows_bytes: int) -> None:
        """Collective when it grows: every rank calls it with the same arguments (derived from the
        count matrix every rank holds, or from the layer's expert count)."""
        if self.buffer is not None and num_experts <= self.num_experts and rows_bytes <= self.rows_bytes:
            return
        import torch.distributed._symmetric_memory as symm_mem

        if self.buffer is not None:
            # Peers wrote into this buffer up to our last barrier; once our stream is past it, no
            # peer touches the buffer again (see the module docstring).
            torch.cuda.current_stream(self.device).synchronize()
        num_experts, rows_bytes = max(num_experts, self.num_experts), max(rows_bytes, self.rows_bytes)
        counts_bytes = _round_up(self.world * num_experts * 8, 256)
        total = counts_bytes + rows_bytes
        try:
            buffer = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
            handle = symm_mem.rendezvous(buffer, self.group)
        except Exception as exc:  # e.g. a container without the IPC rights that peer mappings need
            raise RuntimeError(
                f"peer rows: symmetric memory of {total} bytes for the EP group failed on EP rank {self.rank} "
                f"({type(exc).__name__}: {exc}); set {TRANSPORT_ENV}=nccl on every rank to move tokens with "
                "the NCCL all-to-all instead"
            ) from exc
        self.num_experts, self.rows_bytes = num_experts, rows_bytes  # only once the buffer exists
        offset = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
        bases = [p + offset for p in handle.buffer_ptrs]
        self.buffer, self.handle = buffer, handle
        self.peer_counts = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self.peer_rows = torch.tensor([b + self.counts_bytes for b in bases], dtype=torch.int64, device=self.device)
        self.signal_pads = handle.signal_pad_ptrs_dev  # device array of every rank's signal pad
        self.host_counts = torch.empty(self.world * self.num_experts, dtype=torch.int64, pin_memory=True)
        self._counts_views = {}

    def barrier(self) -> None:
        self.lib.barrier(self.signal_pads, 0, self.rank, self.world, _BARRIER_TIMEOUT_NS,
                         torch.cuda.current_stream(self.device).cuda_stream)

    def counts_views(self, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(this rank's counts region, its pinned host copy), flat [R * num_experts] int64 each."""
        views = self._counts_views.get(num_experts)
        if views is None:
            n = self.world * num_experts
            views = self._counts_views[num_experts] = (self.buffer[: n * 8].view(torch.int64), self.host_counts[:n])
        return views

    def rows(self, num_rows: int, row_shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This rank's rows region as [num_rows, *row_shape] of ``dtype``."""
        row_bytes = dtype.itemsize
        for s in row_shape:
            row_bytes *= s
        start = self.counts_bytes
        return self.buffer[start:start + num_rows * row_bytes].view(dtype).view(num_rows, *row_shape)

    def move(self, push: bool, local: torch.Tensor, plan: "RowPlan", status: Optional[torch.Tensor]) -> None:
        """Push ``local``'s rows to their destinations, or pull them from there into ``local``."""
        row_bytes = local.stride(0) * local.element_size()
        self.lib.move(push, local.data_ptr(), local.shape[0], row_bytes, plan.dst_base.data_ptr(),
                      plan.send_end.data_ptr(), plan.num_experts, plan.num_experts // self.world,
                      self.peer_rows.data_ptr(), 0 if status is None else status.data_ptr(), self.max_blocks,
                      torch.cuda.current_stream(self.device).cuda_stream)


_workspaces: dict = {}


def peer_workspace(group, device: torch.device) -> PeerWorkspace:
    """The workspace of ``group`` on ``device`` (created on first use; creation is not collective)."""
    name = (group if group is not None else dist.group.WORLD).group_name
    key = (name, device.index)
    ws = _workspaces.get(key)
    if ws is None:
        ws = _workspaces[key] = PeerWorkspace(group, device)
    return ws


# ---------------------------------------------------------------------------- transport choice
def _local_support(device: torch.device) -> str:
    """'' when this rank can use peer rows, else why not."""
    if device.type != "cuda":
        return f"tensors on {device}"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
        from cutlass_kernels.peer_rows import load_peer_rows

        load_peer_rows()
    except Exception as exc:  # no symmetric memory in this torch, or no nvcc to build the kernels
        return f"{type(exc).__name__}: {exc}"
    return ""


_choices: dict = {}


def use_peer_rows(group, device: torch.device, num_experts: int, row_bytes: int) -> bool:
    """Whether the EP group moves rows of ``row_bytes`` bytes through peer memory. Collective on the
    first call per (group, device): every rank must agree, or one would wait in a barrier the
    others never enter (the arguments are the layer's config, the same on every rank)."""
    if group_size(group) == 1:
        return False
    wanted = os.environ.get(TRANSPORT_ENV, "auto")
    if wanted not in ("auto", "peer", "nccl"):
        raise ValueError(f"{TRANSPORT_ENV} must be 'auto', 'peer' or 'nccl', got {wanted!r}")
    if wanted == "nccl":
        return False
    backend = dist.get_backend(group)
    unfit = [why for bad, why in (
        (backend != "nccl", f"the EP group runs {backend}, not nccl"),
        (row_bytes % 16 != 0, f"rows of {row_bytes} bytes (a multiple of 16 is needed)"),
        (num_experts > _MAX_EXPERTS, f"{num_experts} experts (at most {_MAX_EXPERTS})"),
    ) if bad]
    if unfit:  # the same on every rank: the layer's config and the group's backend
        if wanted == "peer":
            raise ValueError(f"{TRANSPORT_ENV}=peer but peer rows cannot run: {'; '.join(unfit)}")
        return False
    g = group if group is not None else dist.group.WORLD
    key = (g.group_name, device.index)
    if key not in _choices:  # the reasons why not, per (group, device); empty: peer rows run
        mine = (socket.gethostname(), _local_support(device))
        everyone: List = [None] * group_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        hosts = {h for h, _ in everyone}
        why = [f"rank {r}: {w}" for r, (_, w) in enumerate(everyone) if w]
        if len(hosts) > 1:
            why.append(f"ranks on {len(hosts)} hosts")
        _choices[key] = why
    why = _choices[key]
    if why and wanted == "peer":
        raise RuntimeError(f"{TRANSPORT_ENV}=peer but peer rows are unavailable: {'; '.join(why)}")
    return not why


# ---------------------------------------------------------------------------- the moves
@dataclass
class RowPlan:
    """One dispatch's row map (on the device) and its counts (on the host); combine reuses it."""

    workspace: PeerWorkspace
    num_experts: int
    dst_base: torch.Tensor  # int64 [E]: row i of expert e goes to row i + dst_base[e] of rank e // El
    send_end: torch.Tensor  # int64 [E]: cumulative rows this rank sends, by global expert
    local_sizes: torch.Tensor  # int64 [El]: rows each local expert receives (device)
    local_offsets: torch.Tensor  # int32 [El]: their cumulative end rows (device)
    counts: List[int] = field(default_factory=list)  # the count matrix [R, E], row-major (host)
    num_sent: int = 0
    num_received: int = 0

    def matrix_row(self, r: int) -> List[int]:
        return self.counts[r * self.num_experts:(r + 1) * self.num_experts]

    def received_by(self, d: int) -> int:
        El = self.num_experts // self.workspace.world
        return sum(sum(self.counts[r * self.num_experts + d * El:r * self.num_experts + (d + 1) * El])
                   for r in range(self.workspace.world))


def _plan_scratch(E: int, El: int, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One allocation for a plan's device tensors (dst_base, send_end, local sizes, int32 local
    offsets, int32 status): the dispatch sits between the step's host read and its first GEMM, so
    every host microsecond counts (docs/moe.md "The host read")."""
    scratch = torch.empty(2 * E + El + (El + 2) // 2, dtype=torch.int64, device=device)
    small = scratch[2 * E + El:].view(torch.int32)
    return scratch[:E], scratch[E:2 * E], scratch[2 * E:2 * E + El], small[:El], small[El:El + 1]


def exchange_and_push(ws: PeerWorkspace, counts_E: torch.Tensor, rows_S: torch.Tensor) -> RowPlan:
    """Count exchange, row map and push of ``rows_S`` (rows sorted by global expert, ``counts_E[e]``
    rows of expert e). Returns once the count matrix is on the host, usually with the push still
    running. Negative counts (the in-band error flag) move nothing; the caller checks ``plan.counts``
    and raises on every rank before it uses the rows.
    """
    if torch.cuda.current_device() != ws.device.index:  # the launches below go to the current device
        with torch.cuda.device(ws.device):
            return exchange_and_push(ws, counts_E, rows_S)
    E, R, me = counts_E.numel(), ws.world, ws.rank
    if E % R != 0:
        raise ValueError(f"{E} experts are not divisible by the EP size {R}")
    if counts_E.dtype != torch.int64 or rows_S.dim() != 2 or not rows_S.is_contiguous():
        raise ValueError(f"expected int64 counts and contiguous 2-D rows, got {counts_E.dtype} and "
                         f"shape {tuple(rows_S.shape)} (contiguous={rows_S.is_contiguous()})")
    row_bytes = rows_S.shape[1] * rows_S.element_size()
    if row_bytes % 16 != 0:
        raise ValueError(f"peer rows need rows of a multiple of 16 bytes, got {row_bytes}")
    stream = torch.cuda.current_stream(ws.device).cuda_stream
    ws.ensure(E, ws.rows_bytes)
    dst_base, send_end, local_sizes, local_offsets, status = _plan_scratch(E, E // R, ws.device)
    plan = RowPlan(ws, E, dst_base, send_end, local_sizes, local_offsets, num_sent=rows_S.shape[0])
    counts_E = counts_E.contiguous()
    for _attempt in range(2):
        # One host call queues the whole device sequence (module docstring): barrier, put counts,
        # barrier, plan, count matrix to the host + event, push, barrier.
        matrix, host = ws.counts_views(E)
        ws.lib.dispatch(ws.signal_pads, me, R, _BARRIER_TIMEOUT_NS, counts_E.data_ptr(), E, ws.peer_counts.data_ptr(),
                        matrix.data_ptr(), ws.rows_bytes // row_bytes, dst_base.data_ptr(), send_end.data_ptr(),
                        local_sizes.data_ptr(), local_offsets.data_ptr(), status.data_ptr(), host.data_ptr(),
                        rows_S.data_ptr(), rows_S.shape[0], row_bytes, ws.peer_rows.data_ptr(), ws.max_blocks, stream)
        ws.lib.wait_counts()
        plan.counts = host.tolist()
        if min(plan.counts, default=0) < 0:
            return plan  # nothing moved; the caller raises on every rank
        received = [plan.received_by(d) for d in range(R)]
        need = max(received) * row_bytes
        if need <= ws.rows_bytes:
            break
        # Every rank saw this count matrix, so every rank grows here and pushes again.
        ws.ensure(E, _round_up(int(need * _GROWTH), _ALIGN))
    else:  # unreachable: the second push fits the region grown for it
        raise RuntimeError(f"peer rows: {need} bytes did not fit the grown rows region of {ws.rows_bytes}")
    plan.num_received = received[me]
    return plan


class _ReceiveRows(torch.autograd.Function):
    """Forward: the received rows, copied out of the rows region as contiguous column blocks.
    Backward: the blocks' gradients copied into the region, then pulled back to the senders."""

    @staticmethod
    def forward(ctx, rows_S, plan, columns):
        ws, N = plan.workspace, plan.num_received
        region = ws.rows(N, (rows_S.shape[1],), rows_S.dtype)
        ctx.plan, ctx.shape, ctx.dtype = plan, rows_S.shape, rows_S.dtype
        starts = [0]
        for c in columns:
            starts.append(starts[-1] + c)
        ctx.starts = starts
        return tuple(region[:, a:b].clone(memory_format=torch.contiguous_format) for a, b in zip(starts, starts[1:]))

    @staticmethod
    def backward(ctx, *grads):
        with torch.cuda.device(ctx.plan.workspace.device):
            return _ReceiveRows._backward(ctx, grads)

    @staticmethod
    def _backward(ctx, grads):
        plan, ws = ctx.plan, ctx.plan.workspace
        ws.barrier()
        region = ws.rows(plan.num_received, (ctx.shape[1],), ctx.dtype)
        for g, a, b in zip(grads, ctx.starts, ctx.starts[1:]):
            if g is None:
                region[:, a:b].zero_()
            else:
                region[:, a:b].copy_(g)
        ws.barrier()
        grad_S = torch.empty(ctx.shape, dtype=ctx.dtype, device=ws.device)
        ws.move(False, grad_S, plan, None)
        return grad_S, None, None


def receive_rows(rows_S: torch.Tensor, plan: RowPlan, columns: Optional[Tuple[int, ...]] = None):
    """The rows pushed by :func:`exchange_and_push` that landed on this rank, grouped by (local
    expert, source rank), as contiguous blocks of ``columns`` (default: one block of all columns).
    Differentiable with respect to ``rows_S``."""
    columns = (rows_S.shape[1],) if columns is None else tuple(columns)
    if sum(columns) != rows_S.shape[1]:
        raise ValueError(f"columns {columns} do not add up to the {rows_S.shape[1]} columns of the rows")
    return _ReceiveRows.apply(rows_S, plan, columns)


class _SendBack(torch.autograd.Function):
    """Forward: expert outputs (grouped by local expert, source rank) home, in the sender's row
    order (copy into the region, then every rank pulls). Backward: the dispatch's push."""

    @staticmethod
    def forward(ctx, y_N, plan):
        ws = plan.workspace
        if y_N.shape[0] != plan.num_received:
            raise ValueError(f"expected {plan.num_received} expert output rows, got {y_N.shape[0]}")
        row_bytes = y_N.shape[1] * y_N.element_size()
        if row_bytes % 16 != 0 or plan.num_received * row_bytes > ws.rows_bytes:
            raise ValueError(f"expert output rows of {row_bytes} bytes do not fit the peer rows region")
        ctx.plan, ctx.shape = plan, y_N.shape
        with torch.cuda.device(ws.device):  # our launches go to the current device
            ws.barrier()
            ws.rows(plan.num_received, tuple(y_N.shape[1:]), y_N.dtype).copy_(y_N)
            ws.barrier()
            out = y_N.new_empty(plan.num_sent, *y_N.shape[1:])
            ws.move(False, out, plan, None)
        return out

    @staticmethod
    def backward(ctx, grad_S):
        plan, ws = ctx.plan, ctx.plan.workspace
        grad_S = grad_S.contiguous()
        with torch.cuda.device(ws.device):
            ws.barrier()
            ws.move(True, grad_S, plan, None)
            ws.barrier()
            return ws.rows(plan.num_received, tuple(ctx.shape[1:]), grad_S.dtype).clone(), None


def send_back(y_N: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """Expert outputs back to the ranks that sent the rows, as [rows sent, ...] in their send order."""
    return _SendBack.apply(y_N.contiguous(), plan)


def expected_layout(matrix_RE: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of the plan kernel's map (pure torch, any device; for tests and the docs):
    ``(dst_rank_S, dst_row_S)`` for each row this rank sends, rows sorted by global expert."""
    R, E = matrix_RE.shape
    El = E // R
    mine = matrix_RE[rank]
    expert_S = torch.repeat_interleave(torch.arange(E, device=matrix_RE.device), mine)
    send_start = torch.cumsum(mine, 0) - mine
    colsum = matrix_RE.sum(0)
    per_rank = colsum.view(R, El)
    base = (torch.cumsum(per_rank, 1) - per_rank).reshape(E)  # base_d(l)
    prefix = torch.cumsum(matrix_RE, 0)[rank] - matrix_RE[rank]  # prefix_me(e)
    dst_base = base + prefix - send_start
    rows = torch.arange(expert_S.numel(), device=matrix_RE.device)
    return expert_S // El, rows + dst_base[expert_S]
