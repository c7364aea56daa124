"""Distributed pieces: recipe consensus, layer and tuning-table agreement across ranks, expert-parallel
groups, token all-to-all, bounded collective waits, a clean exit after gloo collectives.

A thin re-export list; each name lives in the module that owns it.
"""

from .all_to_all import all_to_all_tokens, exchange_counts
from .bounded import CollectiveError, CollectiveTimeoutError, wait_collective
from . import exit_settle  # noqa: F401  (registers the interpreter-exit hook)
from .consensus import ConsensusError, MismatchError, RecipeMismatchError, sync_recipe
from .groups import ExpertParallelGroups, group_rank, group_size, init_expert_parallel_groups
from .layer_agreement import LayerMismatchError
from .tune_agreement import agree_tuned_choices

__all__ = [
    "sync_recipe",
    "RecipeMismatchError",
    "LayerMismatchError",
    "MismatchError",
    "ConsensusError",
    "ExpertParallelGroups",
    "init_expert_parallel_groups",
    "group_rank",
    "group_size",
    "all_to_all_tokens",
    "exchange_counts",
    "CollectiveError",
    "CollectiveTimeoutError",
    "wait_collective",
    "agree_tuned_choices",
]
