"""Expert-parallel row moves through peer-mapped memory, with no copy into or out of a staging buffer.

Why: NCCL's variable-split all-to-all takes its split sizes on the host and moves rows between
private buffers; on the GPUs of one host every rank can read and write its peers' memory directly,
so rows can go from where they are made to where they are used in one pass (docs/moe.md "Peer rows").

Every rank's symmetric buffer holds a counts region [R, E] and a rows region with *this rank's own
rows in its send order* (sorted by global expert). Every move is run by the receiving side of the
dispatch, over the N rows it receives, kept grouped by (local expert, source rank), the grouped
GEMMs' order (peer_rows.cu, "Layout"):

    dispatch   exchange kernel: barrier | counts into row `me` of every rank's counts region |
               barrier | where each received row sits in its sender's region | count matrix into
               pinned host memory, then a flag the host spins on; the sender packs its rows into
               its region (the expand gather writes there) | barrier, all while the host waits for
               the matrix | host: size x | pull the rows into x | barrier
    combine    barrier | push expert outputs into the senders' regions | barrier | the sender sums
               each token's K rows straight from its region
    backward   the combine's: the sender writes the expanded output gradient into its region, the
               receivers pull; the dispatch's: the receivers push the row gradients, the sender
               sums them from its region.

Every move is bracketed by barriers, so between moves only the owner touches its region, and one
workspace per (EP group, device) serves every MoE layer (the ranks run the same sequence of moves,
as with any collective). Each barrier runs torch's symmetric-memory barrier protocol on the buffer's
signal pads, in our own kernel (system-scope release/acquire; a rank that waits 10 minutes traps).

The rows region is sized for the largest number of rows any rank sends (T*K, the same every step
for a fixed batch). It grows collectively in the exchange: every rank sees the same count matrix,
so all of them grow together; rows packed outside the region (it was too small) are copied in.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ....distributed.groups import group_rank, group_size

__all__ = [
    "PeerWorkspace",
    "RowPlan",
    "peer_workspace",
    "begin_exchange",
    "finish_exchange",
    "pull",
    "push",
    "expected_sources",
]

_ALIGN = 2 << 20  # rows region sizes round up to 2 MiB
_GROWTH = 1.25  # headroom when the rows region grows
_MAX_BLOCKS_PER_SM = 4
_BARRIER_TIMEOUT_NS = 600 * 10**9  # a rank that never arrives traps the kernel (an error, not a hang)


_HEADER = 4  # after the host copy of the count matrix: rows sent, rows received, most rows sent, smallest count
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _stream(device: torch.device) -> int:
    """The current stream of ``device``, as the handle the launches take. Every dispatch passes here
    several times between the host read and the pull, so it skips building a torch Stream object."""
    if device.type != "cuda":
        return 0  # (the CPU emulation test)
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _on(device: torch.device):
    """A guard that makes ``device`` current for our launches, switching only when it is not."""
    if torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


class PeerWorkspace:
    """The symmetric buffer of one EP group on one device, and the device tables of peer addresses."""

    def __init__(self, group, device: torch.device):
        from .library import load_peer_rows

        self.group = group if group is not None else dist.group.WORLD
        self.world = group_size(group)
        self.rank = group_rank(group)
        self.device = device
        self.lib = load_peer_rows()
        self.num_experts = 0
        self.rows_bytes = 0
        self.buffer = None
        self.handle = None
        self.host_counts = None
        props = torch.cuda.get_device_properties(device)
        self.max_blocks = props.multi_processor_count * _MAX_BLOCKS_PER_SM
        self.exchanges = 0  # sequence number of the last exchange, which the exchange kernel writes to host_flag
        self.host_flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self.host_flag_ptr = self.host_flag.data_ptr()
        self.host_flag_device = self.lib.device_address(self.host_flag_ptr)
        with torch.cuda.device(device):
            self.exchange_done = self.lib.new_event()  # lets the host's wait tell a failed exchange from a slow one

    # ---------------------------------------------------------------- buffer
    @property
    def counts_bytes(self) -> int:
        return _round_up(self.world * self.num_experts * 8, 256)

    def ensure(self, num_experts: int, rows_bytes: int, keep_bytes: int = 0) -> None:
        """Collective when it grows: every rank calls it with the same sizes (derived from the count
        matrix every rank holds, or from the layer's expert count). The first ``keep_bytes`` of the
        rows region survive a growth (this rank's rows, packed before the exchange)."""
        if self.buffer is not None and num_experts <= self.num_experts and rows_bytes <= self.rows_bytes:
            return
        import torch.distributed._symmetric_memory as symm_mem

        old = self.rows_region(keep_bytes) if self.buffer is not None and keep_bytes else None
        if self.buffer is not None:
            # Peers touch this buffer only between the barriers of a move; once our stream is past
            # the last one, none does again (see the module docstring).
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
                f"({type(exc).__name__}: {exc}); build the MoE layer with transport='all_to_all' (or set "
                f"TE_DIST_EP_TRANSPORT=all_to_all on every rank) to move tokens with the NCCL all-to-all instead"
            ) from exc
        self.num_experts, self.rows_bytes = num_experts, rows_bytes  # only once the buffer exists
        offset = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
        bases = [p + offset for p in handle.buffer_ptrs]
        self.buffer, self.handle = buffer, handle
        self.peer_counts = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self.peer_rows = torch.tensor([b + self.counts_bytes for b in bases], dtype=torch.int64, device=self.device)
        self.peer_rows_ptr = self.peer_rows.data_ptr()
        self.signal_pads = handle.signal_pad_ptrs_dev  # device array of every rank's signal pad
        host_size = self.world * self.num_experts + _HEADER
        if self.host_counts is None or self.host_counts.numel() < host_size:  # kept otherwise: it may hold a
            # plan's matrix not read yet (RowPlan.read_counts)
            self.host_counts = torch.empty(host_size, dtype=torch.int64,
                                           pin_memory=self.device.type == "cuda")  # (CPU: the emulation test)
            self.host_counts_device = self.lib.device_address(self.host_counts.data_ptr())  # where the kernel writes
        self._counts_views = {}
        if old is not None:
            self.rows_region(keep_bytes).copy_(old)

    def barrier(self) -> None:
        self.lib.barrier(self.signal_pads, 0, self.rank, self.world, _BARRIER_TIMEOUT_NS, _stream(self.device))

    def counts_views(self, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(this rank's counts region, its pinned host copy, flat [R * num_experts] int64 each, and
        the header the exchange kernel writes after the copy, [4] int64: see _HEADER)."""
        views = self._counts_views.get(num_experts)
        if views is None:
            n = self.world * num_experts
            views = self._counts_views[num_experts] = (self.buffer[: n * 8].view(torch.int64), self.host_counts[:n],
                                                       self.host_counts[n:n + _HEADER])
        return views

    def rows_region(self, num_bytes: int) -> torch.Tensor:
        """The first ``num_bytes`` of this rank's rows region (uint8)."""
        if num_bytes > self.rows_bytes:
            raise ValueError(f"peer rows: {num_bytes} bytes do not fit the rows region of {self.rows_bytes} bytes")
        return self.buffer[self.counts_bytes:self.counts_bytes + num_bytes]

    def region(self, num_rows: int, columns: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """This rank's rows region as [num_rows, columns] of ``dtype``, or None where it does not fit
        (yet: the exchange grows it)."""
        num_bytes = num_rows * columns * dtype.itemsize
        if self.buffer is None or num_bytes > self.rows_bytes:
            return None
        return self.rows_region(num_bytes).view(dtype).view(num_rows, columns)

    def move(self, push: bool, plan: "RowPlan", blocks: Sequence[torch.Tensor]) -> None:
        """One pull or push of this rank's received rows (no barriers): ``blocks`` are one or two
        contiguous [N, w] tensors, a row's column blocks; the senders' regions hold them side by side."""
        a, b = (blocks[0], blocks[1]) if len(blocks) == 2 else (blocks[0], None)
        a_bytes = a.shape[1] * a.element_size()
        b_bytes = 0 if b is None else b.shape[1] * b.element_size()
        table = plan.scratch.data_ptr()  # block_end [E], then src_base [E]
        self.lib.move(push, a.data_ptr(), a_bytes, 0 if b is None else b.data_ptr(), b_bytes, plan.num_received,
                      table, table + 8 * plan.num_experts, plan.num_experts, self.world, self.peer_rows_ptr,
                      self.max_blocks, _stream(self.device))


_workspaces: dict = {}


def peer_workspace(group, device: torch.device) -> PeerWorkspace:
    """The workspace of ``group`` on ``device`` (created on first use; creation is not collective)."""
    name = (group if group is not None else dist.group.WORLD).group_name
    key = (name, device.index)
    ws = _workspaces.get(key)
    if ws is None:
        ws = _workspaces[key] = PeerWorkspace(group, device)
    return ws


# ---------------------------------------------------------------------------- the moves
@dataclass
class RowPlan:
    """One dispatch's row map (on the device) and its sizes (on the host); combine reuses it."""

    workspace: PeerWorkspace
    num_experts: int
    row_bytes: int  # of the rows the dispatch moves (a multiple of 16)
    # int64 on the device, one allocation: block_end [E] (cumulative end row of received block b =
    # (local expert, source rank)), src_base [E] (received row n of block b is row n + src_base[b] of
    # its sender's region), local sizes [El] (rows each local expert receives), then their cumulative
    # end rows as int32 [El]. Only pointers into it are taken before the pull (every host
    # microsecond between the host read and the pull idles the GPU; docs/moe.md "The host read").
    scratch: torch.Tensor
    seq: int  # the exchange's sequence number (the host flag's value once the matrix is on the host)
    num_sent: int = 0
    num_received: int = 0
    invalid: bool = False  # a rank sent the in-band error flag (negative counts): nothing may move
    _counts: Optional[List[int]] = None

    @property
    def local_sizes(self) -> torch.Tensor:
        E, El = self.num_experts, self.num_experts // self.workspace.world
        return self.scratch[2 * E:2 * E + El]

    @property
    def local_offsets(self) -> torch.Tensor:
        E, El = self.num_experts, self.num_experts // self.workspace.world
        return self.scratch[2 * E + El:].view(torch.int32)[:El]

    def read_counts(self) -> List[int]:
        """The count matrix [R, E], row-major, read from the pinned host copy on first use, which must
        come before the next exchange overwrites it (the dispatch reads it right after queueing its pull)."""
        if self._counts is None:
            ws = self.workspace
            if ws.exchanges != self.seq:
                raise RuntimeError(f"peer rows: the count matrix of exchange {self.seq} was overwritten by exchange "
                                   f"{ws.exchanges} before it was read")
            self._counts = ws.counts_views(self.num_experts)[1].tolist()
        return self._counts

    def matrix_row(self, r: int) -> List[int]:
        return self.read_counts()[r * self.num_experts:(r + 1) * self.num_experts]


def begin_exchange(ws: PeerWorkspace, counts_E: torch.Tensor, row_bytes: int) -> RowPlan:
    """Queue the count exchange and the row map for rows of ``row_bytes`` bytes sorted by global
    expert, ``counts_E[e]`` of expert e; collective. Returns at once: queue the packing of this
    rank's rows into ``ws.region`` next (it runs on the device while the host waits in
    :func:`finish_exchange`). One exchange per device is in flight at a time. Bad arguments raise
    before anything is launched or allocated."""
    E, R = counts_E.numel(), ws.world
    if E % R != 0:
        raise ValueError(f"{E} experts are not divisible by the EP size {R}")
    if counts_E.dtype != torch.int64 or row_bytes % 16 != 0:
        raise ValueError(f"expected int64 counts and rows of a multiple of 16 bytes, got {counts_E.dtype} and "
                         f"{row_bytes} bytes")
    if torch.cuda.current_device() != ws.device.index:  # the launches below go to the current device
        with torch.cuda.device(ws.device):
            return begin_exchange(ws, counts_E, row_bytes)
    ws.ensure(E, ws.rows_bytes)
    El = E // R
    scratch = torch.empty(2 * E + El + (El + 1) // 2, dtype=torch.int64, device=ws.device)  # RowPlan.scratch
    ws.exchanges += 1
    plan = RowPlan(ws, E, row_bytes, scratch, ws.exchanges)
    table = scratch.data_ptr()
    counts_E = counts_E.contiguous()
    # One kernel (module docstring): barrier, put counts, barrier, plan, count matrix and header into
    # the pinned host copy, then the sequence number into the host flag finish_exchange spins on.
    ws.lib.exchange(ws.signal_pads, ws.rank, R, _BARRIER_TIMEOUT_NS, counts_E.data_ptr(), E, ws.peer_counts.data_ptr(),
                    ws.counts_views(E)[0].data_ptr(), table, table + 8 * E, table + 16 * E, table + 8 * (2 * E + El),
                    ws.host_counts_device, ws.host_flag_device, plan.seq, ws.exchange_done, _stream(ws.device))
    return plan


def finish_exchange(plan: RowPlan, staged: Optional[torch.Tensor] = None) -> None:
    """Queue a barrier (after this rank's packing, so the host waits while it runs), wait for the
    exchange kernel's header (rows sent and received; :meth:`RowPlan.read_counts` reads the whole
    matrix later, off the path to the pull), then make sure every rank's rows are in its region:
    where some rank's rows do not fit, every rank grows its region (they all see the same matrix),
    keeping the rows packed into it; a rank whose rows did not fit packed them into ``staged``
    instead, copied in here.
    Negative counts (the in-band error flag) set ``plan.invalid``: the caller moves nothing and
    raises, on every rank."""
    ws, row_bytes = plan.workspace, plan.row_bytes
    with _on(ws.device):
        ws.barrier()  # queued after this rank's packing: once past it, every rank's rows are in place
        ws.lib.wait_counts(ws.host_flag_ptr, plan.seq, ws.exchange_done)
    plan.num_sent, plan.num_received, most_sent, least = ws.counts_views(plan.num_experts)[2].tolist()
    plan.invalid = least < 0
    if plan.invalid:
        return
    need = most_sent * row_bytes
    if need > ws.rows_bytes:  # every rank saw this matrix: all of them grow here (a rank stages only then)
        plan.read_counts()
        with _on(ws.device):
            keep = 0 if staged is not None else plan.num_sent * row_bytes
            ws.ensure(plan.num_experts, _round_up(int(need * _GROWTH), _ALIGN), keep_bytes=keep)
            if staged is not None:
                ws.rows_region(plan.num_sent * row_bytes).copy_(staged.reshape(-1).view(torch.uint8))
            ws.barrier()  # every rank's rows are in its new region
    elif staged is not None and staged.numel():
        raise RuntimeError("peer rows: rows were staged outside a region they fit in")  # see ws.region


def pull(plan: RowPlan, blocks: Sequence[torch.Tensor], barrier_before: bool = True) -> None:
    """Fill ``blocks`` (one or two contiguous [N, w] tensors, a received row's column blocks) from
    the senders' regions; collective. ``barrier_before=False`` right after :func:`finish_exchange`,
    whose barrier already follows every sender's packing."""
    ws = plan.workspace
    with _on(ws.device):  # our launches go to the current device
        if barrier_before:
            ws.barrier()
        ws.move(False, plan, blocks)
        ws.barrier()


def push(plan: RowPlan, blocks: Sequence[torch.Tensor]) -> None:
    """Write ``blocks`` (as for :func:`pull`) into the senders' regions, at the rows they came from; collective."""
    ws = plan.workspace
    with _on(ws.device):
        ws.barrier()
        ws.move(True, plan, blocks)
        ws.barrier()


def expected_sources(matrix_RE: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of the plan kernel's map (pure torch, any device; for tests and the docs):
    ``(src_rank_N, src_row_N)`` of each row this rank receives, rows grouped by (local expert,
    source rank); ``src_row`` indexes the sender's rows sorted by global expert."""
    R, E = matrix_RE.shape
    El = E // R
    send_start = torch.cumsum(matrix_RE, 1) - matrix_RE  # [R, E]
    mine = slice(rank * El, (rank + 1) * El)
    lengths = matrix_RE[:, mine].t().reshape(-1)  # blocks in (local expert, source rank) order
    starts = send_start[:, mine].t().reshape(-1)
    src_rank = torch.arange(R, device=matrix_RE.device).repeat(El)
    block = torch.repeat_interleave(torch.arange(E, device=matrix_RE.device), lengths)
    within = torch.arange(block.numel(), device=matrix_RE.device) - (torch.cumsum(lengths, 0) - lengths)[block]
    return src_rank[block], starts[block] + within
