"""All-to-all token dispatcher: permute → count exchange → token all-to-all → sort by local expert.

Legend: T tokens, K top-k, S = T*K, H hidden, E global experts, R = EP size, El = E / R,
N rows received by this rank.

Dispatch (combine runs the same steps backwards; autograd reverses every step):

    x_TH, indices_TK
      │ permute_tokens                      x_SH        rows by global expert 0..E-1
      │                                     (with R > 1 and El > 1 and probabilities in the expert:
      │                                      a payload of x rows + probability bytes, one all-to-all
      │                                      for both, te_dist.moe.payload)
      │ exchange_counts (all-to-all, int64) counts_recv [R, El]
      │ (queued on the device: probabilities in row order, split_sizes_El = counts_recv.sum(0)
      │  and its int32 cumulative offsets for the grouped GEMMs, the local-expert sort index and
      │  its inverse for an upper bound of the row count)
      │ one device→host read of both count vectors (needed to size the variable all-to-all)
      │ all_to_all_tokens                   x_NH        rows by (source rank, local expert)
      │ permute_rows(chunk_sort_index)      x_NH        rows by (local expert, source rank)
      │ (payload: unpack_rows, the same gather for x_NH and probs_N)
      ▼ expert MLP with split_sizes_El (offsets on the device: state.local_expert_offsets,
                                         sizes on the host: state.local_expert_sizes)

With ``row_alignment`` (the native FP8 GEMMs' padding, te_dist.moe.padding) and sizes that lack
it, the last row gather writes the padded layout itself: the expand gather at EP size 1 (queued
after the host read then, since it needs the sizes), the local-expert sort otherwise. The padding's
row maps are queued before the read, from the counts on the device, for as many rows as the sort
indices, and cut to the sizes after it. At EP size 1 with ``gather_in_experts`` the expand gather is
left to the experts (``state.rows``, te_dist.ops.RowGather): x_TH is handed out as it is. A rank that
receives one expert's rows (El = 1, no sort) leaves the padding to the layer.

The host read drains the stream, so the GPU idles until the host queues the next kernel: only the
token all-to-all(s) and the row gathers come after it. Everything that needs the counts only on the
device is queued before it and runs while the host waits (the ~20 small kernels of the sort index
would otherwise run on an idle GPU after the read: docs/moe.md "The host read"), and
the host work after it is kept short (one all-to-all where the payload applies, no host→device
copy of the split sizes: docs/moe.md "The host read").

Experts are sharded contiguously (base.py), so the permuted rows for rank r are one contiguous
block of x_SH and no extra gather is needed. A ``tag`` (the layer's agreement digest,
te_dist.distributed.layer_agreement) rides in the count exchange as one more int64 per destination
rank; every rank gets every rank's tag in ``state.peer_tags``.

Every all-to-all wait is bounded (``timeout_s``, default: the EP group's timeout) and a stuck or
dead peer raises te_dist.distributed.CollectiveError naming the step (dispatch, combine, their
backward) on every live rank, instead of a hang (te_dist.distributed.bounded).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...distributed.all_to_all import all_to_all_tokens, exchange_counts
from ...distributed.bounded import check_timeout_s
from ..padding import needs_padding, queue_padding_plan
from ..payload import pack_expand, unpack_rows
from ..permutation import (
    PermutationState,
    chunk_sort_index,
    chunk_unsort_index,
    expand_rows,
    expand_tokens,
    permute_probs,
    permute_rows,
    permute_tokens,
    sort_by_expert,
    unpermute_rows,
    unpermute_tokens,
)
from .base import DispatchState, TokenDispatcher, read_counts

__all__ = ["AllToAllDispatcher"]


# The sort indices built before the host read cover min(R, _BOUND_FACTOR) x the rows this rank sends.
# R x is the most a rank receives when ranks hold equal token counts, but at large EP sizes only very
# skewed routing comes near it, and index memory grows with the bound. A rank that receives more
# builds the exact indices after the read (correct, just not hidden behind other work).
_BOUND_FACTOR = 4


def _chunk_indices(counts_RL, num_rows):
    """(sort index, its inverse) of the (rank, expert) -> (expert, rank) row reorder for ``num_rows`` rows."""
    return chunk_sort_index(counts_RL, num_rows), chunk_unsort_index(counts_RL, num_rows)


class AllToAllDispatcher(TokenDispatcher):
    """The token all-to-all over the EP process group (NCCL on GPUs, gloo on CPUs); the identity
    for a group of one. Runs wherever the group's backend runs. ``timeout_s`` bounds each
    all-to-all wait (None: the EP group's timeout)."""

    name = "all_to_all"

    def __init__(self, num_experts: int, ep_group=None, *, timeout_s: Optional[float] = None):
        self.timeout_s = check_timeout_s(timeout_s)
        super().__init__(num_experts, ep_group)

    def dispatch(self, x_TH, probs_TK, indices_TK, *, probs_in_expert: bool, invalid=None, tag=None,
                 row_alignment=None, gather_in_experts=False, during_read=None):  # TokenDispatcher's
        R, El = self.ep_size, self.num_local_experts
        sort_rows = R > 1 and El > 1
        # With an all-to-all and a local sort, the probabilities ride in the token rows: one
        # all-to-all instead of two, each way (te_dist.moe.payload).
        packed = probs_in_expert and sort_rows
        # At EP size 1 the expand gather is the last one: it waits for the sizes where it may pad.
        local_pad = R == 1 and row_alignment is not None
        if packed or local_pad:
            perm = sort_by_expert(x_TH, indices_TK, self.num_experts)
        else:
            rows_S, perm = permute_tokens(x_TH, indices_TK, self.num_experts)
        counts_send = self._flag_invalid(perm.counts_E, invalid)
        width = El + (tag is not None)  # entries per rank in the exchange: counts, then the tag
        sent = counts_send if tag is None else torch.cat([counts_send.view(R, El), tag.expand(R, 1)], 1).view(-1)
        counts_recv = exchange_counts(sent, self.ep_group, timeout_s=self.timeout_s)
        # Queued before the host read (module docstring): none of it needs the counts on the host.
        probs_S = permute_probs(probs_TK, perm) if probs_in_expert and not local_pad else None
        if packed:
            rows_S = pack_expand(x_TH, probs_S, perm)
        counts_recv_RL = counts_recv.view(R, width)[:, :El]
        split_sizes_El = counts_recv_RL.sum(dim=0)
        offsets_El = torch.cumsum(split_sizes_El, 0, dtype=torch.int32)  # the grouped GEMMs' offsets
        if sort_rows:
            bound = min(R, _BOUND_FACTOR) * rows_S.shape[0]  # see _BOUND_FACTOR
            chunk_idx, chunk_inv = _chunk_indices(counts_recv_RL, bound)
        # the padding maps, for as many rows as the sort indices (cut to the sizes after the read)
        pad_here = row_alignment is not None and (R == 1 or sort_rows)
        if pad_here:
            queued = queue_padding_plan(split_sizes_El, row_alignment, bound if sort_rows else perm.sort_idx_S.numel())
            if local_pad:  # the permutation into the padded layout, for the bound too
                padded_perm = _padded_permutation(perm, queued)
        # The single device→host read of the step: the all-to-all needs host split lists.
        host = read_counts(torch.cat([counts_send, counts_recv]), during_read)
        sent_RL = [host[r * El:(r + 1) * El] for r in range(R)]
        recv_RL = [host[self.num_experts + r * width:self.num_experts + r * width + El] for r in range(R)]
        peer_tags = None if tag is None else [host[self.num_experts + r * width + El] for r in range(R)]
        self._raise_if_invalid({r for r in range(R) if min(recv_RL[r], default=0) < 0}
                               | ({self.ep_rank} if min(host[:self.num_experts], default=0) < 0 else set()))
        input_splits = [sum(c) for c in sent_RL]
        output_splits = [sum(c) for c in recv_RL]
        local_expert_sizes = [sum(col) for col in zip(*recv_RL)] if recv_RL else []
        plan = None  # the padding, where this dispatch folds it into its last gather
        if pad_here and needs_padding(local_expert_sizes, row_alignment):
            if sum(local_expert_sizes) > queued.row_map.numel():  # more rows than the bound (_BOUND_FACTOR)
                queued = queue_padding_plan(split_sizes_El, row_alignment, sum(local_expert_sizes))
            plan = queued.sized(local_expert_sizes)
        rows = None  # the expand gather, where the experts take it (gather_in_experts)
        if local_pad:
            if plan is not None:
                perm = _cut(padded_perm, plan)
            if gather_in_experts:
                rows = expand_rows(perm)
                rows_S = x_TH
            else:
                rows_S = expand_tokens(x_TH, perm)
            probs_S = permute_probs(probs_TK, perm) if probs_in_expert else None
            output_splits = input_splits = [perm.token_S.shape[0]]
        rows_N = rows_S if rows is not None else all_to_all_tokens(
            rows_S, output_splits, input_splits, self.ep_group, op="token dispatch (all_to_all)",
            timeout_s=self.timeout_s)
        probs_N = None
        pad_rows = None
        if sort_rows:
            num_rows = rows_N.shape[0]
            if num_rows > bound:  # more rows than the bound (see _BOUND_FACTOR): build the exact indices now
                chunk_idx, chunk_inv = _chunk_indices(counts_recv_RL, num_rows)
            chunk_idx, chunk_inv = chunk_idx[:num_rows], chunk_inv[:num_rows]
            if plan is not None:
                chunk_idx, chunk_inv = plan.compose(chunk_idx, chunk_inv)
                pad_rows = plan.pad_rows
            if packed:
                x_NH, probs_N = unpack_rows(rows_N, chunk_idx, chunk_inv, x_TH.shape[1], probs_S.dtype, pad_rows)
            else:
                x_NH = permute_rows(rows_N, chunk_idx, chunk_inv, pad_rows)
        else:
            x_NH, chunk_idx, chunk_inv = rows_N, None, None
            if probs_in_expert:
                probs_N = all_to_all_tokens(probs_S, output_splits, input_splits, self.ep_group,
                                            op="probability dispatch (all_to_all)", timeout_s=self.timeout_s)
        state = DispatchState(
            perm, input_splits, output_splits, chunk_idx, chunk_inv, None if probs_in_expert else probs_TK,
            local_expert_sizes, offsets_El, peer_tags=peer_tags, transport="all_to_all" if R > 1 else "local",
            padded_splits=None if plan is None else plan.splits, pad_rows=pad_rows, rows=rows,
        )
        return x_NH, split_sizes_El, probs_N, state

    def combine(self, y_NH: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Expert outputs (rows by local expert) → [T, H] in the original token order."""
        if state.chunk_idx is not None:
            y_NH = unpermute_rows(y_NH, state.chunk_idx, state.chunk_inv, state.pad_rows)
        y_SH = all_to_all_tokens(y_NH, state.input_splits, state.output_splits, self.ep_group,
                                 op="token combine (all_to_all)", timeout_s=self.timeout_s)
        return unpermute_tokens(y_SH, state.permutation, state.probs_TK)


def _padded_permutation(perm: PermutationState, queued) -> PermutationState:
    """``perm`` writing the padded layout of ``queued`` (EP size 1: the permuted rows are the received
    ones), for all the rows the maps were queued for: cut to the real sizes by :func:`_cut`."""
    return PermutationState(perm.sort_idx_S.index_select(0, queued.src), perm.counts_E, perm.num_tokens, perm.top_k,
                            queued.row_map.index_select(0, perm.inverse_S), perm.token_S.index_select(0, queued.src))


def _cut(padded: PermutationState, plan) -> PermutationState:
    """The padded permutation of the sizes of ``plan`` (views)."""
    num_padded = len(plan.src_P)
    return PermutationState(padded.sort_idx_S[:num_padded], padded.counts_E, padded.num_tokens, padded.top_k,
                            padded.inverse_S, padded.token_S[:num_padded], plan.pad_rows)
