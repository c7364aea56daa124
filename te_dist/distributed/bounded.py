"""Collectives that end: wait at most the group's timeout, and say which collective failed where.

Why: a stuck peer (SIGSTOP, a hung kernel, a dead host) must become an error on every live rank,
not a hang. gloo applies a process group's timeout to most collectives but not to
``all_to_all`` (a rank waits there forever), so te_dist's collectives are started with
``async_op=True`` and waited with the timeout here. NCCL groups are waited without a host
timeout (a timed wait would synchronise the host on every call); NCCL's own watchdog aborts a
collective after the group's timeout.

The timeout is the group's own (``init_process_group(timeout=...)`` / ``new_group(timeout=...)``;
``te-dist train`` sets it from ``train.collective_timeout_s``) unless a caller passes one.

On a timeout, each timed-out rank posts its name to the job's rendezvous store and waits briefly
for the others: ranks of the group that post nothing are named as not responding (stopped,
dead, or busy outside this collective), so every live rank's error points at the stuck peer.
"""

from __future__ import annotations

import datetime
import time
from typing import Optional

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "check_timeout_s",
    "group_timeout_s",
    "wait_collective",
    "DEFAULT_TIMEOUT_S",
]

DEFAULT_TIMEOUT_S = 300.0  # used when a group's timeout cannot be read
_ANSWER_WINDOW_S = 2.0  # how long a timed-out rank waits for its peers' posts (the report's delay)
_STORE_PREFIX = "te_dist/collective_timeout/"


class CollectiveError(RuntimeError):
    """A collective failed on this rank: names the rank, the operation and the group's ranks."""

    def __init__(self, message: str, *, op: str, rank: int, group_ranks: list, unresponsive=None):
        super().__init__(message)
        self.op = op
        self.rank = rank
        self.group_ranks = group_ranks
        self.unresponsive = unresponsive  # global ranks that did not answer (None: unknown)


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within its timeout: a peer is stuck or dead."""


def check_timeout_s(timeout_s) -> Optional[float]:
    """``timeout_s`` as a float, or None (the group's timeout); raises before any collective starts."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be seconds (int or float) or None, got {type(timeout_s).__name__} {timeout_s!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    return float(timeout_s)


def group_timeout_s(group) -> float:
    """The timeout ``group`` (None: the default group) was created with, in seconds."""
    pg = group if group is not None else dist.group.WORLD
    try:
        device = torch.device("cuda") if "nccl" in str(dist.get_backend(pg)) else torch.device("cpu")
        return pg._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):  # private API: fall back to the documented default
        return DEFAULT_TIMEOUT_S


def _is_gloo(group) -> bool:
    return "gloo" in str(dist.get_backend(group if group is not None else dist.group.WORLD))


def _global_ranks(group) -> list:
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _unresponsive(group_ranks: list, rank: int) -> Optional[list]:
    """Ranks of the group that did not post a timeout of their own within the answer window."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_STORE_PREFIX}{rank}", "1")
        deadline = time.monotonic() + _ANSWER_WINDOW_S
        while True:
            missing = [r for r in group_ranks if r != rank and not store.check([f"{_STORE_PREFIX}{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # the store is a diagnostic aid only; the error is raised without it
        return None


def wait_collective(work, op: str, group, *, timeout_s: Optional[float] = None,
                    limit_name: str = "train.collective_timeout_s") -> None:
    """Wait for ``work`` (from ``async_op=True``); raise :class:`CollectiveError` naming ``op`` on failure.

    ``timeout_s`` (default: the group's timeout) bounds the wait on gloo groups; see the module docstring.
    ``limit_name``: the setting a timeout error names as the one that sets the limit.
    """
    if timeout_s is None:
        timeout_s = group_timeout_s(group)
    started = time.monotonic()
    gloo = _is_gloo(group)
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s)) if gloo else work.wait()
        cause = None if ok is not False else "the collective did not complete"
    except Exception as exc:  # gloo raises on its timeout and on a closed peer connection
        cause = exc
    if cause is None:
        return
    elapsed = time.monotonic() - started
    rank, ranks = dist.get_rank(), _global_ranks(group)
    where = f"rank {rank}: {op} (group ranks {ranks})"
    if elapsed >= 0.99 * timeout_s:
        missing = _unresponsive(ranks, rank)
        who = (f"; rank(s) {missing} did not respond (stopped, dead, or busy outside this collective)"
               if missing else "")
        raise CollectiveTimeoutError(
            f"{where} did not finish within {timeout_s:g} s{who} ({limit_name} sets the limit)",
            op=op, rank=rank, group_ranks=ranks, unresponsive=missing,
        ) from (cause if isinstance(cause, BaseException) else None)
    raise CollectiveError(
        f"{where} failed after {elapsed:.1f} s: a peer closed its connection or failed "
        f"({str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__})",
        op=op, rank=rank, group_ranks=ranks,
    ) from (cause if isinstance(cause, BaseException) else None)
