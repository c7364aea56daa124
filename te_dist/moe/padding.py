"""Pad every local expert's rows to a multiple (zero rows), and drop them again on the way back.

Why: the native FP8 grouped GEMMs quantize their wgrad operands along the token dimension in
blocks (128 rows for Float8BlockScaling, 16-row TMA alignment for per-tensor FP8), so every
expert's first row must sit on a block boundary. The rows reach the experts grouped by local
expert with the sizes on the host; a :class:`PaddingPlan` maps them into a buffer whose groups
start on multiples of ``alignment`` (the zero rows contribute nothing to the weight gradients and
their outputs are dropped). With ``te_dist.settings.pad_expert_total_rows`` the last expert also takes
the zero rows that bring the total to a multiple of :data:`TOTAL_ROWS` (:func:`total_alignment`): the
per-tensor FP8 casts of the expert rows write a transposed copy whose rows are the total's bytes long,
and they store ~18% slower when those rows are not 128-byte aligned (docs/moe.md "The expert rows'
total"). No host sync: the maps are built on the device, from the counts already there
(:func:`queue_padding_plan`, queued before the dispatcher's host read, then cut to the sizes the
read brings) or from host sizes copied once, asynchronously (:func:`plan_padding`).
On CUDA two Triton kernels write all maps (te_dist.moe.padding_triton; off with
``te_dist.settings.triton_padding``), elsewhere torch ops.

Two ways to apply a plan:
  * folded into a row gather the dispatcher runs anyway (:meth:`PaddingPlan.compose`: the
    gather reads straight into the padded layout, so padding adds no pass over the rows; the
    all-to-all dispatcher does this, te_dist.moe.transports.all_to_all);
  * on its own (:func:`pad_expert_rows`): a gather in, a gather out, for transports whose rows
    arrive without a final gather.

Legend: N rows received, P padded rows, H hidden, El local experts.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple, Optional

import torch

from .. import settings
from ..lazy_import import optional_module
from ..ops import GroupSplits
from ..ops.basic.grouped_linear import host_split_alignment, remember_split_alignment
from ..support import is_op_fuser_grouped_tensor_supported, native_split_alignment

__all__ = ["PaddedRows", "PaddingPlan", "QueuedPadding", "TOTAL_ROWS", "max_padding_rows", "native_row_alignment",
           "needs_padding", "pad_expert_rows", "padded_sizes", "plan_padding", "queue_padding_plan",
           "total_alignment"]

TOTAL_ROWS = 128  # the padded rows' total multiple with pad_expert_total_rows (128 bytes per transposed FP8 row)


def native_row_alignment(x: torch.Tensor, recipe, linears) -> Optional[int]:
    """The row multiple each local expert's rows must start on, when the active ``recipe``'s native
    grouped path needs one and the op-fuser predicate says that path runs here (at that alignment) for
    the expert MLP's grouped ``linears``; None where the rows may stay as they are."""
    alignment = native_split_alignment(recipe)
    if alignment is None or x.device.type != "cuda" or getattr(recipe, "backward_override", None) is not None:
        return None
    if not all(linear.native_shape_ok for linear in linears):
        return None
    if not is_op_fuser_grouped_tensor_supported(recipe, x.dtype, split_alignment=alignment, device=x.device):
        return None
    return alignment


def total_alignment(alignment: int) -> int:
    """The multiple the padded rows' total is rounded up to: :data:`TOTAL_ROWS` (or ``alignment`` where
    larger) with ``te_dist.settings.pad_expert_total_rows``, else ``alignment`` (no rows beyond the groups')."""
    if not settings.current().pad_expert_total_rows or alignment >= TOTAL_ROWS or TOTAL_ROWS % alignment:
        return alignment
    return TOTAL_ROWS


def padded_sizes(sizes, alignment: int, total: Optional[int] = None) -> tuple:
    """Each size rounded up to a multiple of ``alignment``; the last one also takes the rows that bring
    the sum to a multiple of ``total`` (a multiple of ``alignment``; None: ``alignment``)."""
    padded = [-(-s // alignment) * alignment for s in sizes]
    if padded and total is not None:
        padded[-1] += -sum(padded) % total
    return tuple(padded)


def needs_padding(sizes, alignment: Optional[int]) -> bool:
    """Whether some group of ``sizes`` (host ints) does not start on a multiple of ``alignment`` (all
    groups empty: no). Groups aligned already are left as they are, whatever their total: where the
    padding is not folded into a gather (pad_expert_rows) it costs a copy in and out."""
    if alignment is None:
        return False
    have = host_split_alignment(sizes)
    return have is not None and have % alignment != 0


class PaddingPlan(NamedTuple):
    """Where each received row goes in the padded buffer and back (all int64, on the rows' device)."""

    splits: GroupSplits  # padded offsets (device) and sizes (host)
    row_map_N: Optional[torch.Tensor]  # padded position of each received row (None: already aligned)
    pad_rows: Optional[torch.Tensor] = None  # the padding positions (zeroed, and their gradients too)
    src_P: Optional[torch.Tensor] = None  # the received row each padded position reads (padding: any)

    def compose(self, gather_N: torch.Tensor, scatter: torch.Tensor):
        """Fold the padding into a row reorder: ``gather_N`` gives the source row of each received
        row, ``scatter`` the received position of each source row. Returns the same pair for the
        padded buffer (padding positions read some valid row: zero them after the gather)."""
        return gather_N.index_select(0, self.src_P), self.row_map_N.index_select(0, scatter)


class QueuedPadding(NamedTuple):
    """The maps of a padding plan, queued on the device from device counts for up to ``rows_bound``
    received rows, before the sizes reach the host; :meth:`sized` cuts them to the real sizes.

    Why: a dispatcher knows its local experts' row counts on the device before its one host read;
    queued there, the maps need no host→device copy, run while the host waits in the read, and take
    two kernel launches on CUDA: after the read only views remain (the step's host work is what
    bounds a padded MoE layer, docs/benchmarks.md "FP8 expert MLP")."""

    alignment: int
    offsets: torch.Tensor  # int32 [El]: padded end row of each expert
    row_map: torch.Tensor  # [rows_bound]: padded position of each received row
    src: torch.Tensor  # [rows_bound + pad bound]: received row read by each padded position
    pad_rows: torch.Tensor  # [pad bound = El*(alignment-1) + total - alignment]: padded position of each padding row
    total: int  # the padded total's multiple (total_alignment: TOTAL_ROWS or alignment)

    def sized(self, sizes) -> PaddingPlan:
        """The plan for these sizes (host ints, the counts the maps were queued from; their sum at
        most ``rows_bound``): views of the queued maps, no device work."""
        num_rows = sum(sizes)
        if num_rows > self.row_map.numel():
            raise ValueError(f"sizes sum to {num_rows} rows, more than the {self.row_map.numel()} "
                             "the plan was queued for")
        padded = padded_sizes(sizes, self.alignment, self.total)
        remember_split_alignment(padded, functools.reduce(operator.or_, padded, 0))  # the GEMMs' predicate asks next
        splits = GroupSplits(self.offsets, padded)
        num_padded = sum(padded)
        if num_padded == num_rows:
            return PaddingPlan(splits, None)
        return PaddingPlan(splits, self.row_map[:num_rows], self.pad_rows[:num_padded - num_rows],
                           self.src[:num_padded])


def queue_padding_plan(counts: torch.Tensor, alignment: int, rows_bound: int) -> QueuedPadding:
    """Queue the maps that spread groups of ``counts`` (int64 [El] on the rows' device, summing to at
    most ``rows_bound``) to multiples of ``alignment``. No host sync: counts are read on the device only."""
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment must be a positive int, received {alignment!r}")
    if counts.dim() != 1 or counts.dtype != torch.int64:
        raise ValueError(f"counts must be an int64 vector, received {counts.dtype} {tuple(counts.shape)}")
    counts = counts.contiguous()
    total = total_alignment(alignment)
    if counts.numel() == 0:  # no local experts: no rows
        none = counts.new_empty(0)
        return QueuedPadding(alignment, none.to(torch.int32), none, none, none, total)
    triton_maps = _triton_maps() if counts.is_cuda and counts.numel() <= _MAX_TRITON_EXPERTS else None
    if triton_maps is None:
        maps = _padding_maps_eager(counts, alignment, rows_bound, total)
    elif counts.device.index == torch.cuda.current_device():
        maps = triton_maps(counts, alignment, rows_bound, total)
    else:
        with torch.cuda.device(counts.device):
            maps = triton_maps(counts, alignment, rows_bound, total)
    return QueuedPadding(alignment, *maps, total)


def _lookup(ends: torch.Tensor, values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``values`` of the group each index falls in, for groups ending (exclusive) at sorted ``ends``."""
    group = torch.searchsorted(ends, idx, right=True).clamp_(max=ends.numel() - 1)
    return values.index_select(0, group)


def max_padding_rows(num_experts: int, alignment: int, total: Optional[int]) -> int:
    """The most padding rows ``num_experts`` groups take: alignment - 1 each, and the last one the rows
    that round the total up to ``total`` (a multiple of ``alignment``)."""
    return num_experts * (alignment - 1) + (0 if total is None else total - alignment)


def _padding_maps_eager(counts: torch.Tensor, alignment: int, rows_bound: int, total: Optional[int] = None):
    """The maps of :func:`queue_padding_plan` in torch ops (CPU, and the reference of the Triton kernels)."""
    pad = (-counts).remainder_(alignment)
    if total is not None and total != alignment:  # the last group rounds the total up (no host read)
        pad[-1:] += (-(counts.sum() + pad.sum())).remainder(total)
    ends, pends, pad_ends = counts.cumsum(0), (counts + pad).cumsum(0), pad.cumsum(0)
    shift = pad_ends - pad  # padding rows before the expert: how far its rows move
    pad_bound = max_padding_rows(counts.numel(), alignment, total)
    index = torch.arange(rows_bound + pad_bound, device=counts.device)
    row_map = index[:rows_bound] + _lookup(ends, shift, index[:rows_bound])
    # padded position p of an expert reads received row p - shift; padding reads a neighbour, then zeroed
    src = torch.minimum(index - _lookup(pends, shift, index), ends[-1:] - 1).clamp_(min=0)
    # padding row j of expert e sits at (its first padding row) + j - (padding rows before e)
    pad_rows = index[:pad_bound] + _lookup(pad_ends, pends - pad - shift, index[:pad_bound])
    return pends.to(torch.int32), row_map, src, pad_rows


_MAX_TRITON_EXPERTS = 8192  # the Triton tables kernel holds every local expert in one program


def _triton_maps():
    """The Triton maps (:mod:`.padding_triton`), imported on first CUDA use; None (one warning) without
    Triton, and None while ``te_dist.settings.triton_padding`` is off (torch ops: the reference)."""
    if not settings.current().triton_padding:
        return None
    module = optional_module(".padding_triton", __package__, "te_dist padding Triton kernels", "torch ops")
    return None if module is None else module.padding_maps


def plan_padding(sizes, alignment: int, device) -> PaddingPlan:
    """The plan that spreads groups of ``sizes`` (host ints) to multiples of ``alignment``."""
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment must be a positive int, received {alignment!r}")
    sizes = tuple(int(s) for s in sizes)
    if sizes and min(sizes) < 0:
        raise ValueError(f"expert sizes must be >= 0, received {sizes}")
    counts = torch.tensor(sizes, dtype=torch.int64)
    device = torch.device(device)
    if device.type == "cuda":
        counts = counts.pin_memory()
    return queue_padding_plan(counts.to(device, non_blocking=True), alignment, sum(sizes)).sized(sizes)


def _spread(rows, src_P, pad_rows):
    """rows -> [P, ...]: a row gather, then the padding rows zeroed. A gather, not an
    ``index_copy_`` scatter: the scatter moves 2-byte elements one by one (docs/moe.md has the figures)."""
    return rows.index_select(0, src_P).index_fill_(0, pad_rows, 0)


class _Spread(torch.autograd.Function):
    """rows -> a [P, ...] buffer (row i at ``row_map[i]``), zeros at ``pad_rows``. Backward is the
    gather of the same positions: gathers both ways, no atomic index_add."""

    @staticmethod
    def forward(ctx, rows, src_P, row_map, pad_rows):
        ctx.save_for_backward(row_map)
        return _spread(rows, src_P, pad_rows)

    @staticmethod
    def backward(ctx, grad_out):
        (row_map,) = ctx.saved_tensors
        return grad_out.index_select(0, row_map), None, None, None


class _Gather(torch.autograd.Function):
    """The rows at ``row_map`` of a [P, ...] buffer; backward spreads them back (zeros elsewhere)."""

    @staticmethod
    def forward(ctx, padded, src_P, row_map, pad_rows):
        ctx.save_for_backward(src_P, pad_rows)
        return padded.index_select(0, row_map)

    @staticmethod
    def backward(ctx, grad_rows):
        src_P, pad_rows = ctx.saved_tensors
        return _spread(grad_rows, src_P, pad_rows), None, None, None


class PaddedRows(NamedTuple):
    x_PH: torch.Tensor
    probs_P: Optional[torch.Tensor]
    plan: PaddingPlan

    @property
    def splits(self) -> GroupSplits:
        """The padded offsets (device) and sizes (host)."""
        return self.plan.splits

    @property
    def row_map_N(self) -> Optional[torch.Tensor]:
        """The padded position of each received row (None: the rows were aligned already)."""
        return self.plan.row_map_N

    def unpad(self, y_PH: torch.Tensor) -> torch.Tensor:
        """The rows of the received order (differentiable)."""
        plan = self.plan
        if plan.row_map_N is None:
            return y_PH
        return _Gather.apply(y_PH, plan.src_P, plan.row_map_N, plan.pad_rows)


def pad_expert_rows(x_NH: torch.Tensor, probs_N: Optional[torch.Tensor], sizes, alignment: int) -> PaddedRows:
    """Spread the rows of each local expert (``sizes``, host ints) to groups of multiples of
    ``alignment``, on their own; returns the padded rows, probabilities (zeros on padding) and splits."""
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment must be a positive int, received {alignment!r}")
    sizes = tuple(int(s) for s in sizes)
    if sum(sizes) != x_NH.shape[0]:
        raise ValueError(f"sizes sum to {sum(sizes)} but there are {x_NH.shape[0]} rows")
    plan = plan_padding(sizes, alignment, x_NH.device)
    if plan.row_map_N is None:
        return PaddedRows(x_NH, probs_N, plan)
    x_PH = _Spread.apply(x_NH, plan.src_P, plan.row_map_N, plan.pad_rows)
    probs_P = None if probs_N is None else _Spread.apply(probs_N, plan.src_P, plan.row_map_N, plan.pad_rows)
    return PaddedRows(x_PH, probs_P, plan)
