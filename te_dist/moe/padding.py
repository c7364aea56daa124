"""Pad every local expert's rows to a multiple (zero rows), and drop them again on the way back.

Why: the native FP8 grouped GEMMs quantize their wgrad operands along the token dimension in
blocks (128 rows for Float8BlockScaling, 16-row TMA alignment for per-tensor FP8), so every
expert's first row must sit on a block boundary. The rows reach the experts grouped by local
expert with the sizes on the host; a :class:`PaddingPlan` maps them into a buffer whose groups
start on multiples of ``alignment`` (the zero rows contribute nothing to the weight gradients and
their outputs are dropped). No host sync: the maps are built on the device from the host sizes,
copied once, asynchronously.

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

from ..ops import GroupSplits
from ..ops.basic.grouped_linear import host_split_alignment, remember_split_alignment

__all__ = ["PaddedRows", "PaddingPlan", "needs_padding", "pad_expert_rows", "padded_sizes", "plan_padding"]


def padded_sizes(sizes, alignment: int) -> tuple:
    """Each size rounded up to a multiple of ``alignment``."""
    return tuple(-(-s // alignment) * alignment for s in sizes)


def needs_padding(sizes, alignment: Optional[int]) -> bool:
    """Whether some group of ``sizes`` (host ints) does not start on a multiple of ``alignment``
    (all groups empty: no)."""
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


def plan_padding(sizes, alignment: int, device) -> PaddingPlan:
    """The plan that spreads groups of ``sizes`` (host ints) to multiples of ``alignment``."""
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment must be a positive int, received {alignment!r}")
    # Per expert (columns of one host table, one copy to the device): padded end, shift of its rows,
    # its rows, first padding row, padding rows, padded rows. Whole-tensor host ops, not a loop over
    # the experts in Python: the plan is on every step's host path (docs/benchmarks.md, FP8 expert MLP).
    rows = torch.as_tensor(sizes, dtype=torch.int64, device="cpu").reshape(-1)
    if rows.numel() and int(rows.min()) < 0:
        raise ValueError(f"expert sizes must be >= 0, received {tuple(rows.tolist())}")
    pad = (-rows).remainder_(alignment)
    padded_rows = rows + pad
    sizes, padded = tuple(rows.tolist()), tuple(padded_rows.tolist())
    num_rows, num_padded = sum(sizes), sum(padded)
    remember_split_alignment(padded, functools.reduce(operator.or_, padded, 0))  # the GEMMs' predicate asks next
    ends = padded_rows.cumsum(0)
    padded_starts = ends - padded_rows
    shift = padded_starts - (rows.cumsum(0) - rows)
    first_pad = padded_starts + rows - (pad.cumsum(0) - pad)
    host = torch.stack((ends, shift, rows, first_pad, pad, padded_rows))
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    on_device = host.to(device, non_blocking=True)
    splits = GroupSplits(on_device[0].to(torch.int32), padded)
    if padded == sizes:
        return PaddingPlan(splits, None)
    row_map_N = torch.arange(num_rows, device=device) + torch.repeat_interleave(on_device[1], on_device[2],
                                                                                 output_size=num_rows)
    # padding row j of expert e sits at (its first padding row) + j = base_e + (global padding index)
    num_pad = num_padded - num_rows
    pad_rows = torch.arange(num_pad, device=device) + torch.repeat_interleave(on_device[3], on_device[4],
                                                                               output_size=num_pad)
    # padded position p of expert e reads received row p - (shift of e); padding reads a neighbour, then zeroed
    src_P = (torch.arange(num_padded, device=device)
             - torch.repeat_interleave(on_device[1], on_device[5], output_size=num_padded)).clamp_(0, max(num_rows - 1, 0))
    return PaddingPlan(splits, row_map_N, pad_rows, src_P)


def _spread(rows, src_P, pad_rows):
    """rows -> [P, ...]: a row gather, then the padding rows zeroed. A gather, not an
    ``index_copy_`` scatter: the scatter moved 2-byte elements one by one (3x the gather's time on H200)."""
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
