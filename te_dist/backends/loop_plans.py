"""What the per-expert loop's first call on a bucket costs the host, predicted before it is timed.

Why a module of its own: the loop's cost on a first call is a host stall (a library planning each
new GEMM shape), unlike every other candidate's, and only the tuner's choice of what to time reads it.
"""

from __future__ import annotations

from .selection import Problem

__all__ = ["LoopPlans"]


class LoopPlans:
    """The shapes the loop has planned in this process and, per direction, its last cost per new shape.

    Why: the loop runs one library GEMM (``torch.mm``, cuBLAS) per expert, and the library plans each
    new shape on its first use and may load a kernel for it; on an H200 a first call stalled the
    host 33-108 ms where later calls took ~1 ms (56 new expert sizes: 100 ms), more than a whole
    bucket. Each (direction, dtype, K, N, rows) the loop has run in this process is remembered; a
    bucket's new shapes times the last observed cost per new shape of its direction (``PRIOR_MS``
    before any) must fit in ``SHARE`` of the bucket, or the loop is not a candidate there.

    Why per direction: fwd and dgrad shapes differ in their output rows, and the library picks (and
    loads on first use) a kernel per row count range; wgrad's differ only in the contraction length
    (the output is always N x K), so one kernel serves them. H200, torch 2.11, first calls in sweep
    order (2026-12-03): fwd/dgrad 0.2-3.1 ms per new shape, wgrad 0.1-0.7; one estimate for all
    three let a fwd stall keep the loop out of the next wgrad bucket, where it was the fastest."""

    PRIOR_MS = {"fwd": 2.0, "dgrad": 2.0, "wgrad": 0.5}  # per new shape before any observation
    FLOOR_MS, CEIL_MS = 0.1, 4.0  # an observation is clamped to these: a new shape always costs a
    # plan, and a one-off (the library's own start, ~100 ms) must not shut the loop out for good
    SHARE = 0.25
    MIN_NEW = 2  # one new shape says more about the call's launches than about plans: no update

    def __init__(self):
        self.seen: set = set()
        self.ms_per_new = dict(self.PRIOR_MS)

    def new_shapes(self, p: Problem, group_sizes) -> set:
        head = (p.direction, p.dtype, p.k, p.n)
        return {head + (m,) for m in set(group_sizes) if m > 0} - self.seen

    def estimate(self, new: set) -> float:
        """Predicted ms of the host stall that planning ``new`` (one bucket's new shapes) costs."""
        if not new:
            return 0.0
        return len(new) * self.ms_per_new[_direction(new)]

    def fits(self, new: set, bucket_ms: float) -> bool:
        return self.estimate(new) <= self.SHARE * bucket_ms

    def observe(self, new: set, host_ms: float) -> None:
        """The first call that planned ``new`` (shapes of one direction) took ``host_ms`` on the host."""
        self.seen |= new
        if len(new) >= self.MIN_NEW:
            self.ms_per_new[_direction(new)] = min(self.CEIL_MS, max(self.FLOOR_MS, host_ms / len(new)))


def _direction(new: set) -> str:
    """The direction of a set of new shapes (one bucket's: all share it)."""
    return next(iter(new))[0]
