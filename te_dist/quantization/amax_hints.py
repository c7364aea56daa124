"""Amax hints: max |y| told by the kernel that wrote y, so that a current-scaling cast of y skips its amax pass.

Why: Float8CurrentScaling reads each tensor twice, once for its amax and once to cast it. Where one of our own
kernels writes y (the expert MLP's SwiGLU forward and backward, the fused cross-entropy's gradient of the logits),
it folds max |y| into the same pass (a row's maximum, merged into one int32 with an atomic only where it raises
the value read) and offers it here; the current-scaling quantizer asked for y takes it instead of reading y again.

A hint belongs to y's memory as written: it is found only for a contiguous tensor over the same elements (same data
pointer, element count and dtype: y itself, ``y.detach()``, a reshape of it) while y lives and its version counter
has not moved since the offer (an in-place op bumps it). Anything else misses and runs the amax pass: a hint can go
unused, never give a wrong amax. The value is the int32 bits of max |y| as float32 (NaN above Inf), as the amax
pass computes them from the same rounded elements, so the cast is bit for bit the one without the hint.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

__all__ = ["new_bits", "offer", "take"]

_hints: dict = {}  # (data_ptr, numel, dtype) -> (weakref to y, y's version at the offer, int32 bits [1])


def new_bits(device) -> torch.Tensor:
    """The zeroed int32 a producer kernel merges max |y| into."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def offer(y: torch.Tensor, bits: torch.Tensor) -> None:
    """Record that ``bits`` (int32 [1], filled by the kernel that wrote y, on y's stream) holds max |y|."""
    key = (y.data_ptr(), y.numel(), y.dtype)

    def forget(ref, key=key):
        if _hints.get(key, (None,))[0] is ref:  # not a later offer's entry for reused memory
            del _hints[key]

    _hints[key] = (weakref.ref(y, forget), y._version, bits)


def take(x: torch.Tensor) -> Optional[torch.Tensor]:
    """max |x| as a float32 0-dim tensor from the hint of the tensor x's elements were written as, or None."""
    if not _hints or not x.is_contiguous():
        return None
    entry = _hints.get((x.data_ptr(), x.numel(), x.dtype))
    if entry is None:
        return None
    ref, version, bits = entry
    y = ref()
    if y is None or y._version != version or x._version != version:
        return None
    return bits.view(torch.float32).reshape(())
