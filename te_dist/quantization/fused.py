"""When the hand-written Triton casts (:mod:`.triton_casts`) replace the compiled cast functions.

Why a separate module: the switch and the lazy loader must import without Triton (CI has none),
while ``triton_casts`` imports Triton at module level. The quantizers ask :func:`fused_casts_for`
for the kernel module per call; ``None`` means "use the ``cast`` functions through ``compile.dispatch``".

Policy (``te_dist.settings.fused_casts``: ``TE_DIST_FUSED_CASTS``, ``override(fused_casts=...)``, or
``set_fused_casts_enabled``):
  * ``None`` (default): fused on CUDA devices of compute capability >= 8.9 (FP8 conversions in
    hardware) when ``triton`` imports; a kernel that fails to build warns once and that
    configuration falls back to the compiled path. On by default: the fused kernels pass the
    bit-exact GPU tests and beat the compiled casts (docs/benchmarks.md, "Quantization throughput");
  * ``True``: fused on every device (CPU tensors run in Triton's interpreter, which needs
    ``TRITON_INTERPRET=1`` before Triton is imported: that is how the CPU tests check the kernel
    logic); failures raise, and so does a missing Triton;
  * ``False``: never (the benchmark's "compiled" rows).
Only bf16 / fp16 / fp32 inputs take the fused path (float64 stays on the reference path).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Callable, Optional

import torch

from .. import settings

__all__ = [
    "set_fused_casts_enabled",
    "fused_casts_enabled",
    "fused_casts_available",
    "fused_casts_for",
    "run_fused",
    "transpose_fp8",
    "gather_rows_fp8",
]

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_failed: set = set()


def set_fused_casts_enabled(enabled: Optional[bool]) -> None:
    """None = automatic (CUDA with Triton), True = always (raises if Triton is missing), False = never:
    ``te_dist.settings.fused_casts`` for the rest of the process (``override`` sets it for a while)."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_fused_casts_enabled expects None, True or False, got {enabled!r}")
    if enabled is True and not fused_casts_available():
        raise RuntimeError(f"set_fused_casts_enabled(True) needs triton, which does not import: {_load()[1]}")
    settings.set_for_process(fused_casts=enabled)


def fused_casts_enabled() -> Optional[bool]:
    """The setting in force, ``te_dist.settings.fused_casts`` (None = automatic)."""
    return settings.current().fused_casts


@functools.lru_cache(maxsize=None)
def _load(family: str = "fp8"):
    """(module or None, import error text) of a kernel family ("fp8": ``triton_casts``, "nvfp4":
    ``triton_nvfp4``, "rowcol": ``triton_rowcol``, "adamw_copy": ``triton_adamw_copy``); imported once, on first
    use, never at package import."""
    try:
        if family == "nvfp4":
            from . import triton_nvfp4 as module
        elif family == "rowcol":
            from . import triton_rowcol as module
        elif family == "adamw_copy":
            from . import triton_adamw_copy as module
        else:
            from . import triton_casts as module
    except Exception as exc:  # ImportError without triton; anything else is a broken triton install
        return None, repr(exc)
    return module, ""


def fused_casts_available() -> bool:
    """True when the Triton kernels import (Triton installed)."""
    return _load()[0] is not None


def _device_ok(device: torch.device) -> bool:
    """FP8 conversions in hardware (compute capability >= 8.9) on this CUDA device (an indexed one)."""
    from ..support import device_capability  # the one owner of capability lookups (and its test hook)

    return device_capability(device) >= (8, 9)


def fused_casts_for(x: torch.Tensor, family: str = "fp8"):
    """The kernel module of ``family`` (:func:`_load` names them) when x should take the fused path, else None."""
    enabled = settings.current().fused_casts
    if enabled is False or x.dtype not in FUSED_DTYPES:
        return None
    if enabled is None:
        device = x.device  # a CUDA tensor's device always names its index
        if device.type != "cuda" or not _device_ok(device):
            return None
        return _load(family)[0]
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"fused Triton casts were forced on ({settings.source('fused_casts')}) for a {x.device.type} tensor; "
            "non-CUDA tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported"
        )
    module, error = _load(family)
    if module is None:
        raise RuntimeError(f"fused Triton casts were forced on ({settings.source('fused_casts')}) but their "
                           f"kernels do not import: {error}")
    return module


def run_fused(key: tuple, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, or None when the caller should use the compiled path instead.

    ``triton_casts.UnsupportedLayout`` (a shape these kernels do not tile) returns None for that call only.
    In automatic mode any other failure (a Triton build error) warns once per ``key`` (kernel name +
    static configuration) and disables that key; kernels write only new tensors, so nothing is
    half-updated. Forced mode raises."""
    if key in _failed:
        return None
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        unsupported = getattr(_load()[0], "UnsupportedLayout", ())
        if isinstance(exc, unsupported):
            return None  # this shape only: later calls with other shapes keep the fused path
        if settings.current().fused_casts is True:
            raise
        _failed.add(key)
        warnings.warn(f"te_dist fused Triton cast {key} failed ({exc!r:.300}); using the compiled cast instead")
        return None


def _rowcol_module(data: torch.Tensor):
    """The byte kernels' module (``triton_rowcol``) where the fused casts run for this CUDA data, else None."""
    if settings.current().fused_casts is False or not data.is_cuda or not _device_ok(data.device):
        return None
    return _load("rowcol")[0]


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """``data.transpose(-1, -2).contiguous()`` of FP8 data (each matrix of a stack): the Triton byte
    transpose on CUDA where the fused casts run (torch's transpose copy moves one byte per access), else
    torch's."""
    module = _rowcol_module(data)
    out = None if module is None else run_fused(("transpose_fp8",), module.transpose_fp8, data)
    return data.transpose(-1, -2).contiguous() if out is None else out


def gather_rows_fp8(data: torch.Tensor, index: torch.Tensor, zero_rows=None):
    """``(rows, rows_t)`` of 2-D FP8 bytes (uint8): the rows ``index`` (``zero_rows`` of them zero) and their
    transpose, written in one pass (``triton_rowcol.gather_rows_fp8``) on CUDA where the fused casts run and
    ``te_dist.settings.fp8_gather_transposed`` is on; None: the caller gathers, then transposes."""
    module = _rowcol_module(data) if settings.current().fp8_gather_transposed else None
    return None if module is None else run_fused(("gather_rows_fp8",), module.gather_rows_fp8, data, index, zero_rows)
