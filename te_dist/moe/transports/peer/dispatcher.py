"""``PeerDispatcher``: the token dispatcher whose rows move through peer-mapped memory.

Why: on the GPUs of one host every rank can read and write its peers' memory, so each sender's
expand gather writes its rows into its own region, the counts travel on the device, and each
receiver pulls its rows already grouped by (local expert, source rank): no sort follows, and the
host reads the count matrix once, to size the received rows and the GEMMs' host sizes. The
combine pushes the outputs home, where the K-sum reads them. The probabilities always ride in
the rows when applied in the expert. Needs: NCCL backend, rows of a multiple of 16 bytes, every
rank on one host with symmetric memory and nvcc (availability.py; docs/moe.md "Transports").

    rows.py          the symmetric workspace, the count exchange and the moves
    peer_rows.cu     their kernels; library.py, its ctypes view (built into cutlass_kernels' cache)
    autograd.py      dispatch and combine as autograd functions over the senders' regions
    availability.py  whether every rank of the group can run it
"""

from __future__ import annotations

import torch

from ...permutation import permute_probs, sort_by_expert, unpermute_tokens
from ..base import DispatchState, TokenDispatcher
from .autograd import peer_combine, peer_dispatch
from .availability import use_peer_rows
from .rows import peer_workspace

__all__ = ["PeerDispatcher"]


class PeerDispatcher(TokenDispatcher):
    """Rows through peer memory on the GPUs of one host; the same results as the all-to-all.

    A dispatch where the transport cannot run raises with the reasons (on every rank alike).
    """

    name = "peer"

    def __init__(self, num_experts: int, ep_group=None):
        super().__init__(num_experts, ep_group)
        if self.ep_size == 1:
            raise ValueError("the peer transport moves rows between ranks: it needs an EP group of more than one "
                             "rank, got ep_size=1")
        self._checked = set()  # (device, row bytes) this group agreed it can run

    def check(self, device: torch.device, row_bytes: int, source: str = "transport='peer'") -> None:
        """Raise (ValueError / RuntimeError naming every reason) unless the group can run this
        transport for rows of ``row_bytes`` bytes on ``device``; collective on the first call."""
        if (device, row_bytes) not in self._checked:
            use_peer_rows(self.ep_group, device, row_bytes, required=True, source=source)
            self._checked.add((device, row_bytes))

    def dispatch(self, x_TH, probs_TK, indices_TK, *, probs_in_expert: bool, invalid=None, tag=None,
                 row_alignment=None, gather_in_experts=False, during_read=None):  # TokenDispatcher's (rows arrive
        # unpadded: the layer pads them; the gather is the peer copy's own, never left to the experts; the read
        # is inside peer_dispatch, so during_read is called after it)
        self.check(x_TH.device, x_TH.shape[1] * x_TH.element_size())
        E, R, El = self.num_experts, self.ep_size, self.num_local_experts
        perm = sort_by_expert(x_TH, indices_TK, E)
        probs_S = permute_probs(probs_TK, perm) if probs_in_expert else None
        counts_send = self._flag_invalid(perm.counts_E, invalid)
        x_NH, probs_N, plan = peer_dispatch(peer_workspace(self.ep_group, x_TH.device), x_TH, probs_S, perm, counts_send)
        if plan.invalid:
            self._raise_if_invalid({r for r in range(R) if min(plan.matrix_row(r), default=0) < 0})
        if during_read is not None:
            during_read()
        rows = [plan.matrix_row(r) for r in range(R)]
        mine = slice(self.first_expert, self.first_expert + El)
        state = DispatchState(
            perm, [sum(rows[self.ep_rank][d * El:(d + 1) * El]) for d in range(R)], [sum(row[mine]) for row in rows],
            None, None, None if probs_in_expert else probs_TK, [sum(col) for col in zip(*(row[mine] for row in rows))],
            plan.local_offsets, plan, transport="peer",
        )
        return x_NH, plan.local_sizes, probs_N, state

    def combine(self, y_NH: torch.Tensor, state: DispatchState) -> torch.Tensor:
        if state.probs_TK is None:  # probabilities applied in the expert: the K-sum runs on the region
            return peer_combine(y_NH, state.peer_plan, state.permutation)
        y_SH = peer_combine(y_NH, state.peer_plan, state.permutation, sum_rows=False)
        return unpermute_tokens(y_SH, state.permutation, state.probs_TK)
