"""The expert-row padding maps in two Triton launches (te_dist.moe.padding's device plan on CUDA).

Why: built from torch ops the maps take ~25 small kernels; each costs host time to queue, and a
padded MoE step is host-bound (the Qwen3-like FP8 layer queues work slower than the GPU runs it,
docs/benchmarks.md "FP8 expert MLP"). Here one single-program kernel writes the per-expert tables
(prefix sums of the rows and of their padding) and one kernel writes all three maps, each entry
finding its expert by a binary search over a table.

Same integers as :func:`te_dist.moe.padding._padding_maps_eager` (tested on the GPU). Imported only
through :mod:`.padding`, on CUDA: CI has no Triton.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..quantization.triton_launch import cdiv, launch, next_power_of_2
from .padding import max_padding_rows

__all__ = ["padding_maps"]

_BLOCK = 1024  # map entries per program of the maps kernel
# The tables (int64 [5, El], one row each): 0 row ends, 1 padded ends, 2 padding ends, 3 shift (padding
# rows before the expert: how far its rows move), 4 base (an expert's first padding row minus the
# padding rows before it). Every expert sits in the one program of the tables kernel: El <= 8192
# (te_dist.moe.padding checks).


@triton.jit
def _tables_kernel(counts_ptr, tab_ptr, offsets_ptr, num_experts, ALIGN: tl.constexpr, TOTAL: tl.constexpr,
                   EB: tl.constexpr):
    e = tl.arange(0, EB)
    m = e < num_experts
    rows = tl.load(counts_ptr + e, mask=m, other=0)
    pad = (ALIGN - rows % ALIGN) % ALIGN
    if TOTAL != ALIGN:  # the last expert also rounds the padded total up to a multiple of TOTAL
        extra = (TOTAL - tl.sum(rows + pad, 0) % TOTAL) % TOTAL
        pad = pad + tl.where(e == num_experts - 1, extra, 0)
    ends = tl.cumsum(rows, 0)
    pends = tl.cumsum(rows + pad, 0)
    pad_ends = tl.cumsum(pad, 0)
    shift = pad_ends - pad
    tl.store(tab_ptr + 0 * num_experts + e, ends, mask=m)
    tl.store(tab_ptr + 1 * num_experts + e, pends, mask=m)
    tl.store(tab_ptr + 2 * num_experts + e, pad_ends, mask=m)
    tl.store(tab_ptr + 3 * num_experts + e, shift, mask=m)
    tl.store(tab_ptr + 4 * num_experts + e, pends - pad - shift, mask=m)
    tl.store(offsets_ptr + e, pends.to(tl.int32), mask=m)


@triton.jit
def _expert_of(ends_ptr, num_experts, v, STEPS: tl.constexpr):
    """How many of the sorted ``ends`` are <= v (torch.searchsorted(right=True)), at most the last expert."""
    lo = tl.zeros_like(v)
    hi = lo + num_experts
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        le = tl.load(ends_ptr + mid, mask=active, other=0) <= v
        lo = tl.where(active & le, mid + 1, lo)
        hi = tl.where(active & (le == 0), mid, hi)
    return tl.minimum(lo, num_experts - 1)


@triton.jit
def _maps_kernel(tab_ptr, row_map_ptr, src_ptr, pad_rows_ptr, num_experts, num_rows, num_padded, num_pad,
                 row_programs, src_programs, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    if pid < row_programs:  # received row i -> its padded position
        i = pid.to(tl.int64) * BLOCK + lanes
        e = _expert_of(tab_ptr + 0 * num_experts, num_experts, i, STEPS)
        shift = tl.load(tab_ptr + 3 * num_experts + e)
        tl.store(row_map_ptr + i, i + shift, mask=i < num_rows)
    elif pid < row_programs + src_programs:  # padded position p -> the received row it reads
        p = (pid - row_programs).to(tl.int64) * BLOCK + lanes
        e = _expert_of(tab_ptr + 1 * num_experts, num_experts, p, STEPS)
        shift = tl.load(tab_ptr + 3 * num_experts + e)
        total = tl.load(tab_ptr + 0 * num_experts + num_experts - 1)
        src = tl.maximum(tl.minimum(p - shift, total - 1), 0)
        tl.store(src_ptr + p, src, mask=p < num_padded)
    else:  # padding row j (over all experts) -> its padded position
        j = (pid - row_programs - src_programs).to(tl.int64) * BLOCK + lanes
        e = _expert_of(tab_ptr + 2 * num_experts, num_experts, j, STEPS)
        base = tl.load(tab_ptr + 4 * num_experts + e)
        tl.store(pad_rows_ptr + j, j + base, mask=j < num_pad)


def padding_maps(counts: torch.Tensor, alignment: int, rows_bound: int, total: Optional[int] = None):
    """(offsets int32 [El], row_map [rows_bound], src [rows_bound + pad bound], pad_rows [pad bound]) for
    int64 ``counts`` [El] (1 <= El <= 8192), the padded total a multiple of ``total`` (None: ``alignment``;
    pad bound: :func:`~te_dist.moe.padding.max_padding_rows`), on the current CUDA device (the caller's:
    counts' device)."""
    num_experts = counts.numel()
    pad_bound = max_padding_rows(num_experts, alignment, total)
    padded_bound = rows_bound + pad_bound
    device = counts.device
    tab = torch.empty(5 * num_experts, dtype=torch.int64, device=device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    maps = torch.empty(rows_bound + padded_bound + pad_bound, dtype=torch.int64, device=device)
    row_map, src, pad_rows = maps.split((rows_bound, padded_bound, pad_bound))
    launch(_tables_kernel, (1,), counts, tab, offsets, num_experts, ALIGN=alignment,
           TOTAL=alignment if total is None else total, EB=next_power_of_2(num_experts), num_warps=4)
    row_programs, src_programs = cdiv(rows_bound, _BLOCK), cdiv(padded_bound, _BLOCK)
    programs = row_programs + src_programs + cdiv(pad_bound, _BLOCK)
    if programs:
        launch(_maps_kernel, (programs,), tab, row_map, src, pad_rows, num_experts, rows_bound, padded_bound,
               pad_bound, row_programs, src_programs, STEPS=num_experts.bit_length(), BLOCK=_BLOCK, num_warps=4)
    return offsets, row_map, src, pad_rows
