"""``TransportSelector``: the dispatcher an ``MoELayer`` holds; it picks the transport per call.

Why per call: "auto" depends on the device of the tensors and on every rank's support, known at
the first forward, not at construction; and ``te_dist.settings.ep_transport`` (an override for jobs
and benchmarks: ``TE_DIST_EP_TRANSPORT``, or ``te_dist.settings.override(ep_transport=...)`` between
steps, on every rank alike) may change.

    requested = te_dist.settings.ep_transport if set, else the layer's ``transport``
    EP size 1                      -> "local" (the all-to-all dispatcher, which is then the identity)
    "all_to_all"                   -> AllToAllDispatcher
    "peer"                         -> PeerDispatcher, or raise with the reasons it cannot run
    "auto"                         -> PeerDispatcher where every rank can run it, else AllToAllDispatcher
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import settings
from .all_to_all import AllToAllDispatcher
from .base import TRANSPORTS, DispatchState, TokenDispatcher
from .peer.availability import use_peer_rows
from .peer.dispatcher import PeerDispatcher

__all__ = ["TransportSelector", "check_transport", "requested_transport"]

def check_transport(transport) -> str:
    """``transport`` if it is one of TRANSPORTS, else ValueError naming them."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    return transport


def requested_transport(transport: str):
    """(transport, where it came from): ``te_dist.settings.ep_transport`` where set, else ``transport``."""
    override = settings.current().ep_transport
    if override is None:
        return transport, f"transport={transport!r}"
    return override, settings.source("ep_transport")


class TransportSelector(TokenDispatcher):
    """Dispatches through the transport chosen for each call (module docstring); ``transport`` is
    the one the last dispatch used: "local", "all_to_all" or "peer"."""

    name = "auto"

    def __init__(self, num_experts: int, ep_group=None, transport: str = "auto"):
        super().__init__(num_experts, ep_group)
        self.requested = check_transport(transport)
        self.transport: Optional[str] = None
        self._all_to_all = AllToAllDispatcher(num_experts, ep_group)
        self._peer = None  # built on first use (it needs more than one rank)

    def _peer_dispatcher(self):
        if self._peer is None:
            self._peer = PeerDispatcher(self.num_experts, self.ep_group)
        return self._peer

    def choose(self, device: torch.device, row_bytes: int) -> TokenDispatcher:
        """The dispatcher for rows of ``row_bytes`` bytes on ``device``; collective the first time
        "auto" or "peer" asks every rank whether it can run the peer transport."""
        wanted, source = requested_transport(self.requested)
        if self.ep_size == 1 or wanted == "all_to_all":
            return self._all_to_all
        if wanted == "peer":
            peer = self._peer_dispatcher()
            peer.check(device, row_bytes, source)
            return peer
        return self._peer_dispatcher() if use_peer_rows(self.ep_group, device, row_bytes) else self._all_to_all

    def dispatch(self, x_TH, probs_TK, indices_TK, *, probs_in_expert: bool, invalid=None, tag=None,
                 row_alignment=None, gather_in_experts=False, during_read=None):
        dispatcher = self.choose(x_TH.device, x_TH.shape[1] * x_TH.element_size())
        out = dispatcher.dispatch(x_TH, probs_TK, indices_TK, probs_in_expert=probs_in_expert, invalid=invalid,
                                  tag=tag, row_alignment=row_alignment, gather_in_experts=gather_in_experts,
                                  during_read=during_read)
        self.transport = out[3].transport
        return out

    def combine(self, y_NH: torch.Tensor, state: DispatchState) -> torch.Tensor:
        dispatcher = self._peer if state.transport == "peer" else self._all_to_all
        return dispatcher.combine(y_NH, state)
