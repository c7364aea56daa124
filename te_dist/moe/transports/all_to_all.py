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

The host read drains the stream, so the GPU idles until the host queues the next kernel: only the
token all-to-all(s) and the row gathers come after it. Everything that needs the counts only on the
device is queued before it and runs while the host waits (profiled on 2×H200, the ~20 small
kernels of the sort index took ~0.3 ms of idle GPU time per step when queued after the read), and
the host work after it is kept short (one all-to-all where the payload applies, no host→device
copy of the split sizes: docs/moe.md "The host read").

Experts are sharded contiguously: rank r owns global experts [r*El, (r+1)*El), so the
permuted rows for rank r are one contiguous block of x_SH and no extra gather is needed.

A rank that must fail (NaN or inf router logits) sends -1 counts: every rank sees the flag in the
count exchange and raises the same error before the token all-to-all, so no rank hangs. A ``tag``
(the layer's agreement digest, te_dist.distributed.layer_agreement) rides in the same exchange as
one more int64 per destination rank; every rank gets every rank's tag in ``state.peer_tags``.

Transport. On the GPUs of one host (NCCL backend, symmetric memory available on every rank, the
choice agreed once per group: te_dist.moe.transports.peer.rows.use_peer_rows) the rows move through
peer-mapped memory instead (te_dist.moe.transports.peer.autograd): each sender's expand gather writes its
rows into its own region, the counts travel on the device, and each receiver pulls its rows
grouped by (local expert, source rank), so no sort follows; the combine pushes the outputs home,
where the K-sum reads them. The probabilities always ride in the rows when applied in the expert.
The host reads the count matrix once, to size the received rows and the GEMMs' host sizes.
``TE_DIST_EP_TRANSPORT=nccl`` (on every rank) keeps the all-to-all path.

Every all-to-all wait is bounded (``timeout_s``, default: the EP group's timeout) and a stuck or
dead peer raises te_dist.distributed.CollectiveError naming the step (dispatch, combine, their
backward) on every live rank, instead of a hang (te_dist.distributed.bounded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...distributed.all_to_all import all_to_all_tokens, exchange_counts
from ...distributed.bounded import check_timeout_s
from ...distributed.groups import group_rank, group_size
from .peer.rows import RowPlan, peer_workspace, use_peer_rows
from ..payload import pack_expand, unpack_rows
from .peer.autograd import peer_combine, peer_dispatch
from ..permutation import (
    PermutationState,
    chunk_sort_index,
    chunk_unsort_index,
    permute_probs,
    permute_rows,
    permute_tokens,
    sort_by_expert,
    unpermute_rows,
    unpermute_tokens,
)

__all__ = ["AllToAllDispatcher", "DispatchState", "RoutingError"]


# The sort indices built before the host read cover min(R, _BOUND_FACTOR) x the rows this rank sends.
# R x is the most a rank receives when ranks hold equal token counts, but at large EP sizes only very
# skewed routing comes near it, and index memory grows with the bound. A rank that receives more
# builds the exact indices after the read (correct, just not hidden behind other work).
_BOUND_FACTOR = 4


def _chunk_indices(counts_RL, num_rows):
    """(sort index, its inverse) of the (rank, expert) -> (expert, rank) row reorder for ``num_rows`` rows."""
    return chunk_sort_index(counts_RL, num_rows), chunk_unsort_index(counts_RL, num_rows)


class RoutingError(ValueError):
    """Raised on every rank of the EP group when any rank's routing was invalid."""


@dataclass
class DispatchState:
    """Everything combine needs to send expert outputs home and restore token order."""

    permutation: PermutationState
    input_splits: list  # rows this rank sent to each rank
    output_splits: list  # rows this rank received from each rank
    chunk_idx: Optional[torch.Tensor]  # (rank, expert) → (expert, rank) row permutation, or None
    chunk_inv: Optional[torch.Tensor]  # its inverse (combine and backward gather through it)
    probs_TK: Optional[torch.Tensor]  # set when probabilities are applied at combine
    local_expert_sizes: list  # rows each local expert received (host ints: the read's by-product)
    local_expert_offsets: torch.Tensor  # int32 cumulative end rows of the local experts, on the device
    peer_plan: Optional[RowPlan] = None  # set when the rows moved through peer memory (module docstring)
    peer_tags: Optional[list] = None  # every EP rank's tag (index = EP rank), when a tag rode in the counts


class AllToAllDispatcher:
    """Moves routed token copies to the ranks that own their experts and back.

    Holds no tensors between calls; the per-call state is the returned :class:`DispatchState`.
    ``timeout_s`` bounds each all-to-all wait (None: the EP group's timeout).
    """

    def __init__(self, num_experts: int, ep_group=None, *, timeout_s: Optional[float] = None):
        self.timeout_s = check_timeout_s(timeout_s)
        self.ep_group = ep_group
        self.ep_size = group_size(ep_group)
        self.ep_rank = group_rank(ep_group)
        if num_experts % self.ep_size != 0:
            raise ValueError(f"{num_experts=} is not divisible by ep_size={self.ep_size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts
        self.transport = None  # of the last dispatch: "local" (EP=1), "all-to-all" or "peer"

    def dispatch(
        self,
        x_TH: torch.Tensor,
        probs_TK: torch.Tensor,
        indices_TK: torch.Tensor,
        *,
        probs_in_expert: bool,
        invalid: Optional[torch.Tensor] = None,
        tag: Optional[torch.Tensor] = None,
    ):
        """Returns ``(x_NH, split_sizes_El, probs_N or None, state)``.

        ``invalid``: optional bool scalar tensor (on x's device) that marks this rank's routing as
        bad (e.g. NaN or inf logits); it travels in-band with the counts (see module docstring).
        ``tag``: optional int64 [1] tensor (on x's device) sent to every rank with the counts; the
        all-to-all transport returns every rank's tag in ``state.peer_tags`` (the peer one does not).
        """
        R, El = self.ep_size, self.num_local_experts
        if R > 1 and use_peer_rows(self.ep_group, x_TH.device, x_TH.shape[1] * x_TH.element_size()):
            self.transport = "peer"
            return self._dispatch_peer(x_TH, probs_TK, indices_TK, probs_in_expert, invalid)
        self.transport = "all-to-all" if R > 1 else "local"
        sort_rows = R > 1 and El > 1
        # With an all-to-all and a local sort, the probabilities ride in the token rows: one
        # all-to-all instead of two, each way (te_dist.moe.payload).
        packed = probs_in_expert and sort_rows
        if packed:
            perm = sort_by_expert(x_TH, indices_TK, self.num_experts)
        else:
            rows_S, perm = permute_tokens(x_TH, indices_TK, self.num_experts)
        counts_send = perm.counts_E
        if invalid is not None:
            counts_send = torch.where(invalid, torch.full_like(counts_send, -1), counts_send)
        width = El + (tag is not None)  # entries per rank in the exchange: counts, then the tag
        sent = counts_send if tag is None else torch.cat([counts_send.view(R, El), tag.expand(R, 1)], 1).view(-1)
        counts_recv = exchange_counts(sent, self.ep_group, timeout_s=self.timeout_s)
        # Queued before the host read (module docstring): none of it needs the counts on the host.
        probs_S = permute_probs(probs_TK, perm) if probs_in_expert else None
        if packed:
            rows_S = pack_expand(x_TH, probs_S, perm)
        counts_recv_RL = counts_recv.view(R, width)[:, :El]
        split_sizes_El = counts_recv_RL.sum(dim=0)
        offsets_El = torch.cumsum(split_sizes_El, 0, dtype=torch.int32)  # the grouped GEMMs' offsets
        if sort_rows:
            bound = min(R, _BOUND_FACTOR) * rows_S.shape[0]  # see _BOUND_FACTOR
            chunk_idx, chunk_inv = _chunk_indices(counts_recv_RL, bound)
        # The single device→host read of the step: the all-to-all needs host split lists.
        host = torch.cat([counts_send, counts_recv]).tolist()
        sent_RL = [host[r * El:(r + 1) * El] for r in range(R)]
        recv_RL = [host[self.num_experts + r * width:self.num_experts + r * width + El] for r in range(R)]
        peer_tags = None if tag is None else [host[self.num_experts + r * width + El] for r in range(R)]
        self._raise_if_invalid({r for r in range(R) if min(recv_RL[r], default=0) < 0}
                               | ({self.ep_rank} if min(host[:self.num_experts], default=0) < 0 else set()))
        input_splits = [sum(c) for c in sent_RL]
        output_splits = [sum(c) for c in recv_RL]
        local_expert_sizes = [sum(col) for col in zip(*recv_RL)] if recv_RL else []
        rows_N = all_to_all_tokens(rows_S, output_splits, input_splits, self.ep_group,
                                   op="token dispatch (all_to_all)", timeout_s=self.timeout_s)
        probs_N = None
        if sort_rows:
            num_rows = rows_N.shape[0]
            if num_rows > bound:  # more rows than the bound (see _BOUND_FACTOR): build the exact indices now
                chunk_idx, chunk_inv = _chunk_indices(counts_recv_RL, num_rows)
            chunk_idx, chunk_inv = chunk_idx[:num_rows], chunk_inv[:num_rows]
            if packed:
                x_NH, probs_N = unpack_rows(rows_N, chunk_idx, chunk_inv, x_TH.shape[1], probs_S.dtype)
            else:
                x_NH = permute_rows(rows_N, chunk_idx, chunk_inv)
        else:
            x_NH, chunk_idx, chunk_inv = rows_N, None, None
            if probs_in_expert:
                probs_N = all_to_all_tokens(probs_S, output_splits, input_splits, self.ep_group,
                                            op="probability dispatch (all_to_all)", timeout_s=self.timeout_s)
        state = DispatchState(
            perm, input_splits, output_splits, chunk_idx, chunk_inv, None if probs_in_expert else probs_TK,
            local_expert_sizes, offsets_El, peer_tags=peer_tags,
        )
        return x_NH, split_sizes_El, probs_N, state

    def _raise_if_invalid(self, bad_ranks) -> None:
        if bad_ranks:
            raise RoutingError(
                f"router logits contain NaN or inf on EP rank(s) {sorted(bad_ranks)} (this is EP rank {self.ep_rank}); "
                "check the hidden states fed to the MoE layer and the router weight"
            )

    def _dispatch_peer(self, x_TH, probs_TK, indices_TK, probs_in_expert, invalid):
        """The peer-memory transport (module docstring): same results as the all-to-all path."""
        E, R, El = self.num_experts, self.ep_size, self.num_local_experts
        perm = sort_by_expert(x_TH, indices_TK, E)
        probs_S = permute_probs(probs_TK, perm) if probs_in_expert else None
        counts_send = perm.counts_E
        if invalid is not None:
            counts_send = torch.where(invalid, torch.full_like(counts_send, -1), counts_send)
        x_NH, probs_N, plan = peer_dispatch(peer_workspace(self.ep_group, x_TH.device), x_TH, probs_S, perm, counts_send)
        if plan.invalid:
            self._raise_if_invalid({r for r in range(R) if min(plan.matrix_row(r), default=0) < 0})
        rows = [plan.matrix_row(r) for r in range(R)]
        mine = slice(self.first_expert, self.first_expert + El)
        state = DispatchState(
            perm, [sum(rows[self.ep_rank][d * El:(d + 1) * El]) for d in range(R)], [sum(row[mine]) for row in rows],
            None, None, None if probs_in_expert else probs_TK, [sum(col) for col in zip(*(row[mine] for row in rows))],
            plan.local_offsets, plan,
        )
        return x_NH, plan.local_sizes, probs_N, state

    def combine(self, y_NH: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Expert outputs (rows by local expert) → [T, H] in the original token order."""
        if state.peer_plan is not None:
            if state.probs_TK is None:  # probabilities applied in the expert: the K-sum runs on the region
                return peer_combine(y_NH, state.peer_plan, state.permutation)
            y_SH = peer_combine(y_NH, state.peer_plan, state.permutation, sum_rows=False)
            return unpermute_tokens(y_SH, state.permutation, state.probs_TK)
        if state.chunk_idx is not None:
            y_NH = unpermute_rows(y_NH, state.chunk_idx, state.chunk_inv)
        y_SH = all_to_all_tokens(y_NH, state.input_splits, state.output_splits, self.ep_group,
                                 op="token combine (all_to_all)", timeout_s=self.timeout_s)
        return unpermute_tokens(y_SH, state.permutation, state.probs_TK)
