"""Run the pure cast functions fused on CUDA, eagerly elsewhere.

Why: written eagerly, a quantize is 4-8 elementwise passes over memory; ``torch.compile``
turns each cast function into one fused kernel (plus one reduction for per-tensor amax), which is
what the >= 50%-of-copy-bandwidth goal needs. Compilation is lazy (first CUDA call), never at
import, and if it fails (no Triton, unsupported op) we fall back to eager once, with a warning.

``set_compile_enabled(False)`` forces eager everywhere (benchmarks compare both);
``set_compile_enabled(True)`` also compiles on CPU (tests use it to check the functions trace).
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

__all__ = ["dispatch", "set_compile_enabled", "compile_enabled"]

_state = {"enabled": None}  # None: auto (CUDA only); True: everywhere; False: never
_compiled: dict = {}
_failed: set = set()


def set_compile_enabled(enabled: Optional[bool]) -> None:
    """None = automatic (compile on CUDA only), True = always, False = never."""
    if enabled not in (None, True, False):
        raise TypeError(f"set_compile_enabled expects None, True or False, got {enabled!r}")
    _state["enabled"] = enabled


def compile_enabled(device: torch.device) -> bool:
    enabled = _state["enabled"]
    if enabled is None:
        return device.type == "cuda"
    return enabled


def _get_compiled(fn: Callable) -> Callable:
    compiled = _compiled.get(fn)
    if compiled is None:
        # dynamic=None: specialise on the first shape, go dynamic if shapes vary (token counts do).
        compiled = torch.compile(fn, fullgraph=True, dynamic=None)
        _compiled[fn] = compiled
    return compiled


def dispatch(fn: Callable, x: torch.Tensor, *args, **kwargs):
    """Call ``fn(x, *args, **kwargs)``, compiled when enabled for x's device."""
    if fn in _failed or not compile_enabled(x.device):
        return fn(x, *args, **kwargs)
    try:
        return _get_compiled(fn)(x, *args, **kwargs)
    except Exception as exc:  # compile problems must not break training: warn once, run eager
        _failed.add(fn)
        warnings.warn(f"torch.compile of te_dist.quantization {fn.__name__} failed ({exc!r:.300}); running eagerly")
        return fn(x, *args, **kwargs)
