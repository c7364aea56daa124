"""Pad every local expert's rows to a multiple (zero rows), and drop them again on the way back.

Why: the native FP8 grouped GEMMs quantize their wgrad operands along the token dimension in
blocks (128 rows for Float8BlockScaling, 16-row TMA alignment for per-tensor FP8), so every
expert's first row must sit on a block boundary. The dispatcher hands the experts their rows
grouped by local expert with the sizes on the host; this module spreads those rows into a
buffer whose groups start on multiples of ``alignment`` (the zero rows contribute nothing to the
weight gradients and their outputs are dropped), and gathers the outputs back. Both are
differentiable (row gathers both ways, the padding zeroed), and no host sync is added: the row map is
built on the device from the host sizes, which are copied once, asynchronously.

Legend: N rows received, P padded rows, H hidden, El local experts.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..ops import GroupSplits
from ..ops.basic.grouped_linear import remember_split_alignment

__all__ = ["PaddedRows", "pad_expert_rows", "padded_sizes"]


def padded_sizes(sizes, alignment: int) -> tuple:
    """Each size rounded up to a multiple of ``alignment``."""
    return tuple(-(-s // alignment) * alignment for s in sizes)


def _spread(rows, src_P, pad_rows):
    """rows -> [P, ...]: a row gather (``src_P``: the received row each padded position reads,
    any valid row for padding), then the padding rows zeroed. A gather, not an ``index_copy_``
    scatter: the scatter moved 2-byte elements one by one (3x the gather's time on H200)."""
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
    splits: GroupSplits  # padded offsets (device) and sizes (host)
    row_map_N: Optional[torch.Tensor]  # padded position of each received row (None: already aligned)
    pad_rows: Optional[torch.Tensor] = None  # the padding positions
    src_P: Optional[torch.Tensor] = None  # the received row each padded position reads (padding: any)

    def unpad(self, y_PH: torch.Tensor) -> torch.Tensor:
        """The rows of the received order (differentiable)."""
        if self.row_map_N is None:
            return y_PH
        return _Gather.apply(y_PH, self.src_P, self.row_map_N, self.pad_rows)


def pad_expert_rows(x_NH: torch.Tensor, probs_N: Optional[torch.Tensor], sizes, alignment: int) -> PaddedRows:
    """Spread the rows of each local expert (``sizes``, host ints) to groups of multiples of
    ``alignment``; returns the padded rows, probabilities (zeros on padding) and splits."""
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment must be a positive int, received {alignment!r}")
    sizes = tuple(int(s) for s in sizes)
    if sum(sizes) != x_NH.shape[0]:
        raise ValueError(f"sizes sum to {sum(sizes)} but there are {x_NH.shape[0]} rows")
    padded = padded_sizes(sizes, alignment)
    num_rows, num_padded = x_NH.shape[0], sum(padded)
    bits_or = 0
    for p in padded:
        bits_or |= p
    remember_split_alignment(padded, bits_or)  # the GEMMs' predicate asks for this tuple next
    device = x_NH.device
    # Per expert: padded end, shift of its rows, its rows, first padding row, padding rows, the
    # padding rows before it, and its padded rows (host ints; one copy to the device).
    table, start, pstart, pads_before = [[], [], [], [], [], [], []], 0, 0, 0
    for s, p in zip(sizes, padded):
        for column, value in zip(table, (pstart + p, pstart - start, s, pstart + s - pads_before, p - s, pads_before,
                                         p)):
            column.append(value)
        start, pstart, pads_before = start + s, pstart + p, pads_before + p - s
    host = torch.tensor(table, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    on_device = host.to(device, non_blocking=True)
    offsets = on_device[0].to(torch.int32)
    if padded == sizes:
        return PaddedRows(x_NH, probs_N, GroupSplits(offsets, padded), None)
    row_map_N = torch.arange(num_rows, device=device) + torch.repeat_interleave(on_device[1], on_device[2],
                                                                                 output_size=num_rows)
    # padding row j of expert e sits at (its first padding row) + j = base_e + (global padding index)
    num_pad = num_padded - num_rows
    pad_rows = torch.arange(num_pad, device=device) + torch.repeat_interleave(on_device[3], on_device[4],
                                                                               output_size=num_pad)
    # padded position p of expert e reads received row p - (shift of e); padding reads a neighbour, then zeroed
    src_P = (torch.arange(num_padded, device=device)
             - torch.repeat_interleave(on_device[1], on_device[6], output_size=num_padded)).clamp_(0, num_rows - 1)
    x_PH = _Spread.apply(x_NH, src_P, row_map_N, pad_rows)
    probs_P = None if probs_N is None else _Spread.apply(probs_N, src_P, row_map_N, pad_rows)
    return PaddedRows(x_PH, probs_P, GroupSplits(offsets, padded), row_map_N, pad_rows, src_P)
