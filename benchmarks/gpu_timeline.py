"""GPU busy time and idle gaps of a profiled run (torch.profiler events), for the benchmarks that split a
step's wall time into kernels and waiting."""

from __future__ import annotations

import torch

__all__ = ["busy_span_gap"]


def busy_span_gap(events) -> tuple:
    """(busy, span, longest gap) in µs of the CUDA events (kernels, copies, fills): busy is the union
    of their intervals (overlapping streams counted once), span from the first start to the last end."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return 0.0, 0.0, 0.0
    busy, gap, end = 0.0, 0.0, None
    for s, e in spans:
        if end is None or s > end:
            gap = gap if end is None else max(gap, s - end)
            busy, end = busy + e - s, e
        elif e > end:
            busy, end = busy + e - end, e
    return busy, end - spans[0][0], gap
