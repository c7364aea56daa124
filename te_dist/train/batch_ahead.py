"""The next step's batch, built on the host while the device still runs this step.

Why: a training step ends in a host read of the loss (the all-reduced statistics), which drains the
device; a batch built after that read is host time with the device idle (~0.75 ms for the
DeepSeek-like synthetic batch of 16 x 2048 tokens). Built once the step's optimizer is queued, it
overlaps the device's work. A batch is a pure function of its step (datasets.py), so the values are
the same; an error building it is raised at the step whose batch it is, as without the look-ahead.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["BatchAhead"]


class BatchAhead:
    """One batch built ahead (:meth:`build`), handed out by :meth:`take` for its own step only."""

    def __init__(self, data, rank: int, world_size: int):
        self._data, self._rank, self._world_size = data, rank, world_size
        self._step: Optional[int] = None
        self._batch: Optional[tuple] = None
        self._error: Optional[BaseException] = None

    def build(self, step: int) -> None:
        """Build ``step``'s local batch now (an error is kept for :meth:`take` of that step)."""
        self._step, self._batch, self._error = step, None, None
        try:
            self._batch = self._data.local_batch(step, self._rank, self._world_size)
        except Exception as exc:  # raised where that step takes its batch
            self._error = exc

    def take(self, step: int) -> tuple:
        """``step``'s local batch: the one built ahead for it, else built now."""
        ahead, batch, error = self._step, self._batch, self._error
        self._step, self._batch, self._error = None, None, None
        if ahead != step:
            return self._data.local_batch(step, self._rank, self._world_size)
        if error is not None:
            raise error
        return batch
