"""How routed tokens move between expert-parallel ranks: one dispatcher class per transport.

    base.py        TokenDispatcher (dispatch / combine / the agreed split sizes), DispatchState, RoutingError
    all_to_all.py  AllToAllDispatcher: the token all-to-all over the EP process group
    peer/          PeerDispatcher: rows through peer memory on the GPUs of one host
    selector.py    TransportSelector: what MoELayer(transport="auto" | "all_to_all" | "peer") holds

docs/moe.md "Transports" has what each needs and does.
"""

from .all_to_all import AllToAllDispatcher
from .base import TRANSPORTS, DispatchState, RoutingError, TokenDispatcher
from .peer.dispatcher import PeerDispatcher
from .selector import TransportSelector

__all__ = [
    "TRANSPORTS",
    "TokenDispatcher",
    "DispatchState",
    "RoutingError",
    "AllToAllDispatcher",
    "PeerDispatcher",
    "TransportSelector",
]
