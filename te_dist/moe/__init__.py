"""Mixture of experts: router, token permutation, all-to-all dispatcher and the EP ``MoELayer``.

See ``docs/moe.md`` for the data flow, the layouts at each step and how EP groups are formed.
"""

from .transports import (
    TRANSPORTS,
    AllToAllDispatcher,
    DispatchState,
    PeerDispatcher,
    RoutingError,
    TokenDispatcher,
    TransportSelector,
)
from .layer import MoELayer
from .permutation import PermutationState, permute_tokens, unpermute_tokens
from .router import RoutingResult, TopKRouter, load_balancing_loss, z_loss
from .state_dict import merge_expert_state_dicts

__all__ = [
    "MoELayer",
    "TopKRouter",
    "RoutingResult",
    "load_balancing_loss",
    "z_loss",
    "TRANSPORTS",
    "TokenDispatcher",
    "AllToAllDispatcher",
    "PeerDispatcher",
    "TransportSelector",
    "DispatchState",
    "RoutingError",
    "PermutationState",
    "permute_tokens",
    "unpermute_tokens",
    "merge_expert_state_dicts",
]
