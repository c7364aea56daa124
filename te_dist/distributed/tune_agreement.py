"""Agreement of a group on the measured grouped-GEMM choices (te_dist.gemm.measure).

Why: each rank measures on its own GPU, and two ranks can time the same bucket within noise of each
other and keep different kernels. Where a run must be deterministic across ranks, ranks computing
the same shape must run the same kernel. So the table is agreed once, at a point every rank of the
group reaches (after ahead-of-time tuning, or after warm-up steps), not inside a measurement: ranks
of an EP group see different rows per expert, so their misses differ, and a collective there hangs.

Protocol (the recipe-consensus machinery: the group's gloo side group, collectives with a timeout)::

    every rank    all_gather its exported table (JSON)       the same list on every rank
    every rank    adopt entry 0 (rank 0's), mark the table agreed, stop measuring (freeze)
    every rank    agree_key(digest of rank 0's text)         a check that every rank adopted it

A dead or stuck peer raises ``ConsensusError`` on the survivors within the timeout.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from .consensus import DEFAULT_TIMEOUT_S, MismatchError, _all_gather_text, _Call, _check_timeout, _REGISTRY
from .consensus import _resolve_group, agree_key

__all__ = ["agree_tuned_choices"]


def _mismatch(payloads: list, global_ranks) -> MismatchError:  # unreachable unless adoption itself diverged
    keys = {r: p["key"] for r, p in enumerate(payloads)}
    bad = [r for r, k in keys.items() if k != keys[0]]
    return MismatchError(f"ranks {bad} adopted a different tuning table than rank 0", mismatched_ranks=bad, keys=keys,
                         global_ranks=global_ranks)


def agree_tuned_choices(group=None, *, freeze: bool = True, timeout=None) -> int:
    """Give every rank of ``group`` (default: the world) rank 0's measured choices; returns their count.

    ``freeze`` (default): no rank measures afterwards (``measure.configure(deterministic=True)``),
    so the ranks keep agreeing; a bucket none of rank 0's entries covers takes the static table
    on every rank. Without an initialised process group this only marks the local table agreed.
    Every rank of the group must call it at the same point (it runs collectives).
    """
    from ..gemm import measure  # the kernels stack stays importable without torch.distributed

    tuner = measure.tuner()
    timeout_s = DEFAULT_TIMEOUT_S if timeout is None else _check_timeout(timeout)
    group = _resolve_group(group, "agree_tuned_choices")
    text = json.dumps(tuner.export(), sort_keys=True)
    if group is not None and dist.get_world_size(group) > 1:
        state = _REGISTRY.get(group, timeout_s)
        text = _all_gather_text(state, text, _Call("tuning-table agreement", timeout_s))[0]
        tuner.adopt(json.loads(text))
        agree_key(text, group, payload=lambda: {"key": text}, mismatch=_mismatch, what="tuning-table agreement",
                  timeout=timeout_s)
    else:
        tuner.adopt(json.loads(text))
    if freeze:
        measure.configure(deterministic=True)
    return sum(len(entries) for entries in json.loads(text).values())
