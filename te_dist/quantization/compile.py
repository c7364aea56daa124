"""Run pure tensor functions fused on CUDA, eagerly elsewhere.

Why: written eagerly, a quantize is 4-8 elementwise passes over memory; ``torch.compile``
turns each cast function into one fused kernel (plus one reduction for per-tensor amax). The ops
and the MoE layer use the same mechanism for their memory-bound glue (SwiGLU forward/backward,
the K-way gather-sum of the token combine). Compilation is lazy (first CUDA call), never at
import, and if it fails (no Triton, unsupported op) that configuration runs eagerly, with a warning.

One compiled callable per (function, static configuration): block sizes, formats and the input
dtype are baked into the graph. Each gets its own copy of the function's code object, so
Dynamo's per-code recompile limit (8) counts shape variations of one configuration only, not
every format a model uses (with ``fullgraph=True`` hitting that limit raises instead of
falling back).

The switch is ``te_dist.settings.torch_compile`` (``TE_DIST_TORCH_COMPILE``, ``override(torch_compile=...)``
or ``set_compile_enabled``): None compiles on CUDA only, False forces eager everywhere (benchmarks
compare both), True also compiles on CPU.
"""

from __future__ import annotations

import types
import warnings
from typing import Callable, Optional

import torch

from .. import settings

__all__ = ["dispatch", "set_compile_enabled", "compile_enabled", "forget_compiled"]

_compiled: dict = {}
_failed: set = set()


def set_compile_enabled(enabled: Optional[bool]) -> None:
    """None = automatic (compile on CUDA only), True = always, False = never:
    ``te_dist.settings.torch_compile`` for the rest of the process (``override`` sets it for a while)."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_compile_enabled expects None, True or False, got {enabled!r}")
    settings.set_for_process(torch_compile=enabled)


def compile_enabled(device: torch.device) -> bool:
    """Whether functions on ``device`` run compiled (``te_dist.settings.torch_compile``)."""
    enabled = settings.current().torch_compile
    if enabled is None:
        return device.type == "cuda"
    return enabled


def forget_compiled() -> None:
    """Drop every compiled callable and every remembered failure: the next call compiles afresh
    (after ``torch.compile`` itself changed, e.g. a test's stand-in backend)."""
    _compiled.clear()
    _failed.clear()


def _static_key(fn: Callable, x: torch.Tensor, args: tuple) -> tuple:
    static = tuple(a if not isinstance(a, torch.Tensor) else (a.dtype, a.dim()) for a in args)
    return (fn, x.dtype, x.dim(), x.device.type) + static


def _get_compiled(fn: Callable, key: tuple) -> Callable:
    compiled = _compiled.get(key)
    if compiled is None:
        private = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        # dynamic=None: specialise on the first shape, go dynamic if shapes vary (token counts do).
        compiled = torch.compile(private, fullgraph=True, dynamic=None)
        _compiled[key] = compiled
    return compiled


def dispatch(fn: Callable, x: torch.Tensor, *args):
    """Call ``fn(x, *args)``, compiled when enabled for x's device."""
    if not compile_enabled(x.device):
        return fn(x, *args)
    key = _static_key(fn, x, args)
    if key in _failed:
        return fn(x, *args)
    try:
        return _get_compiled(fn, key)(x, *args)
    except Exception as exc:  # compile problems must not break training: warn once per configuration, run eager
        _failed.add(key)
        warnings.warn(f"torch.compile of te_dist.quantization {fn.__name__} failed ({exc!r:.300}); running eagerly")
        return fn(x, *args)
