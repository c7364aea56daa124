"""The interface every token transport implements, and the state one dispatch hands to its combine.

Legend: T tokens, K top-k, H hidden, E global experts, R = EP size, El = E / R local experts,
N rows this rank's experts receive.

    dispatch(x_TH, probs_TK, indices_TK) -> x_NH (rows by local expert), split_sizes_El, probs_N, state
    (expert MLP on x_NH with state.group_splits(): the split every rank agreed on in the count exchange)
    combine(y_NH, state)                 -> out_TH (the K expert outputs of each token, summed)

Experts are sharded contiguously: rank r owns global experts [r*El, (r+1)*El). A rank that must
fail (NaN or inf router logits) sends -1 counts: every rank sees the flag in the count exchange, which
every transport runs anyway, and raises the same :class:`RoutingError` before any row moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

from ...distributed.groups import group_rank, group_size
from ...ops import GroupSplits, RowGather
from ...settings import EP_TRANSPORTS
from ..permutation import PermutationState

__all__ = ["TRANSPORTS", "DispatchState", "RoutingError", "TokenDispatcher", "read_counts"]

TRANSPORTS = EP_TRANSPORTS  # what MoELayer(transport=...) accepts; te_dist.settings.ep_transport overrides it


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
    peer_plan: Any = None  # the peer transport's RowPlan (transports/peer) when the rows moved that way
    peer_tags: Optional[list] = None  # every EP rank's tag (index = EP rank), when a tag rode in the counts
    transport: str = "all_to_all"  # the transport that made this state: "local", "all_to_all" or "peer"
    padded_splits: Optional[GroupSplits] = None  # the split of the rows handed out, when the dispatch padded them
    pad_rows: Optional[torch.Tensor] = None  # the padding rows of the local reorder (chunk_idx), when padded
    rows: Optional[RowGather] = None  # the last row gather, when left to the experts (gather_in_experts)

    def group_splits(self) -> GroupSplits:
        """The split of the rows the dispatch handed out over the local experts, both ways: offsets
        on the device (queued before the host read) and sizes on the host (that read's by-product);
        with padding (``row_alignment``), the padded split; with ``rows``, the split carries them as
        ``rows_in`` (the experts' first GEMM reads its rows from the dispatch's x, te_dist.ops.RowGather)."""
        splits = self.padded_splits
        if splits is None:
            splits = GroupSplits(self.local_expert_offsets, tuple(self.local_expert_sizes))
        return splits if self.rows is None else splits._replace(rows_in=self.rows)


def read_counts(counts: torch.Tensor, during_read: Optional[Callable[[], None]] = None) -> list:
    """``counts.tolist()``, the dispatch's device->host read; with ``during_read``, that work is queued
    between the copy and the host's wait (a CUDA copy into pinned memory, an event the host waits on), so it
    runs on the GPU while the host waits for the counts and goes on with them."""
    if during_read is None:
        return counts.tolist()
    if not counts.is_cuda:
        during_read()
        return counts.tolist()
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    during_read()
    copied.synchronize()
    return host.tolist()


class TokenDispatcher:
    """Moves routed token copies to the ranks that own their experts and back.

    Subclasses set ``name`` and implement :meth:`dispatch` and :meth:`combine`; they hold no
    tensors between calls (the per-call state is the returned :class:`DispatchState`).
    """

    name = ""  # the transport, as MoELayer(transport=...) spells it

    def __init__(self, num_experts: int, ep_group=None):
        self.ep_group = ep_group
        self.ep_size = group_size(ep_group)
        self.ep_rank = group_rank(ep_group)
        if num_experts % self.ep_size != 0:
            raise ValueError(f"{num_experts=} is not divisible by ep_size={self.ep_size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts

    def dispatch(
        self,
        x_TH: torch.Tensor,
        probs_TK: torch.Tensor,
        indices_TK: torch.Tensor,
        *,
        probs_in_expert: bool,
        invalid: Optional[torch.Tensor] = None,
        tag: Optional[torch.Tensor] = None,
        row_alignment: Optional[int] = None,
        gather_in_experts: bool = False,
        during_read: Optional[Callable[[], None]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], DispatchState]:
        """Returns ``(x_NH, split_sizes_El, probs_N or None, state)``; rows grouped by local expert.

        ``probs_in_expert``: the probabilities travel with the rows (``probs_N``) instead of being
        applied at combine. ``invalid``: optional bool scalar tensor (on x's device) that marks this
        rank's routing as bad (e.g. NaN or inf logits); it travels in-band with the counts. ``tag``:
        optional int64 [1] tensor (on x's device) sent to every rank with the counts; the all-to-all
        transport returns every rank's tag in ``state.peer_tags`` (the peer one does not).
        ``row_alignment``: the row multiple each local expert's group should start on (the native
        FP8 GEMMs' padding, te_dist.moe.padding); a transport that can fold the padding into its
        last row gather does, and ``state.group_splits()`` is then the padded split (the returned
        ``split_sizes_El`` stays the received counts). Others ignore it: check the split.
        ``gather_in_experts``: a transport whose last row gather reads x_TH itself (the expand at EP
        size 1) may leave it to the experts: it returns x_TH as ``x_NH`` and the gather as
        ``state.rows`` (te_dist.ops.RowGather; ``state.group_splits().rows_in``: the experts' first GEMM
        reads its rows through it, and their last may sum its rows back through it, the combine).
        Others ignore it: check ``state.rows``.
        ``during_read``: called once per dispatch, with no arguments, to queue device work that needs no
        counts (the experts' weight casts): where the transport reads the counts with a copy it can wait on
        (:func:`read_counts`), after that copy is queued and before the host waits, so the GPU runs that work
        while the host waits and reads; a transport whose read sits inside its own kernels calls it after.
        """
        raise NotImplementedError

    def combine(self, y_NH: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Expert outputs (rows by local expert) → [T, H] in the original token order."""
        raise NotImplementedError

    @staticmethod
    def _flag_invalid(counts_E: torch.Tensor, invalid: Optional[torch.Tensor]) -> torch.Tensor:
        """The counts to send: all -1 where this rank's routing is bad (the in-band error flag)."""
        if invalid is None:
            return counts_E
        return torch.where(invalid, torch.full_like(counts_E, -1), counts_E)

    def _raise_if_invalid(self, bad_ranks) -> None:
        if bad_ranks:
            raise RoutingError(
                f"router logits contain NaN or inf on EP rank(s) {sorted(bad_ranks)} (this is EP rank {self.ep_rank}); "
                "check the hidden states fed to the MoE layer and the router weight"
            )
