"""Triton launches without Triton's per-call binding: a repeat launch finds its compiled kernel by a
key of a few Python operations and calls it directly.

Why: ``kernel[grid](...)`` spends most of its host time on work a repeat launch does not need
(Triton 3.6: the argument binder, a cache-key string, knob reads, launch metadata for hooks nobody
set), and a quantized expert-MLP step makes 14 of them; issue 26 bounds that step's host time at
1.5x bf16's (docs/benchmarks.md, "FP8 expert MLP", has the same-run A/B).

Exactness: the key is never coarser than Triton's own specialization. Per argument it records what
Triton specializes on (a tensor's dtype and whether its address is 16-byte aligned; an int's
equality to 1, divisibility by 16 and width; the type of a float, bool or None), plus every constexpr
and launch option by value and the current device. Two calls with one key therefore get the same
compiled kernel from Triton; the first call of a key goes through ``kernel[grid](...)`` itself, which
compiles (or finds) that kernel, launches it and returns it.

Triton's own path is taken, every call, where this one cannot promise the same launch: Triton's
interpreter (``kernel[grid]`` returns no compiled kernel), launch hooks installed (profilers read
launch metadata), an argument of another type (tuples, descriptors), a parameter left to its default,
or a compiled kernel without the launch interface used here (``run``, ``function``,
``packed_metadata``; Triton 3.x).

Imports no Triton at module level: ``triton.knobs`` is read on the first launch.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["TritonLaunch", "launch", "arg_key", "cdiv", "next_power_of_2"]

_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)
# torch's C entry points Triton itself uses (absent from CPU-only builds: then no fast path)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_knobs = None  # triton.knobs once a launch has needed it


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grids: ``triton.cdiv`` is a constexpr function, slow to call from the host."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), without ``triton.next_power_of_2``'s constexpr call."""
    return 1 << (n - 1).bit_length()


def _runtime_knobs():
    """``triton.knobs`` (Triton >= 3.4), or None: then no fast path (older Triton keeps these elsewhere)."""
    global _knobs
    if _knobs is None:
        try:
            from triton import knobs
        except ImportError:
            return None
        _knobs = knobs
    return _knobs


def _hooks_installed(runtime) -> bool:
    """A launch hook someone installed (Triton 3.6 keeps empty ``HookChain``s; older ones None)."""
    for hook in (getattr(runtime, "launch_enter_hook", None), getattr(runtime, "launch_exit_hook", None)):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def arg_key(arg) -> Optional[tuple]:
    """What Triton specializes a non-constexpr argument on (or finer); None: a type not handled here."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, not arg.data_ptr() & 15)
    kind = type(arg)
    if kind is bool or kind is float or arg is None:
        return (kind,)
    if kind is int:
        if arg == 1:
            return (int, 1)
        return (int, not arg & 15, _I32[0] <= arg <= _I32[1], _I64[0] <= arg <= _I64[1])
    return None


class TritonLaunch:
    """``launch(grid, *args, **constexprs_and_options)`` does what ``kernel[grid](*args, **...)`` does,
    minus the per-call binding once its key has been launched. ``args`` are the kernel's leading
    parameters in order; every later parameter is given by name (this package's call sites do so)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.params: Tuple[str, ...] = tuple(getattr(kernel, "arg_names", ()))
        self.compiled: Dict[tuple, Any] = {}
        self.knobs = _runtime_knobs()
        # False: Triton's path every call
        self.fast = bool(self.params) and _current_device is not None and self.knobs is not None

    def key(self, grid, args, meta) -> Optional[tuple]:
        """The launch key of one call (None: Triton's path for this call)."""
        if type(grid) is not tuple or not 1 <= len(grid) <= 3:
            return None  # a grid function reads Triton's bound arguments
        for name in self.params[len(args):]:
            if name not in meta:
                return None  # a parameter left to its default: Triton binds it
        keys = []
        for arg in args:
            if isinstance(arg, torch.Tensor):  # most arguments: inline of arg_key's first case
                keys.append((arg.dtype, not arg.data_ptr() & 15))
                continue
            k = arg_key(arg)
            if k is None:
                return None
            keys.append(k)
        knobs = self.knobs
        return (_current_device(), tuple(keys), tuple(meta.items()), knobs.runtime.debug,
                getattr(knobs.compilation, "instrumentation_mode", None))

    def __call__(self, grid, *args, **meta):
        key = self.key(grid, args, meta) if self.fast else None
        try:
            compiled = None if key is None else self.compiled.get(key)
        except TypeError:  # an unhashable constexpr
            key = compiled = None
        if compiled is None or _hooks_installed(self.knobs.runtime):
            result = self.kernel[grid](*args, **meta)
            if key is not None:
                self._remember(key, result)
            return
        full = args + tuple(meta[name] for name in self.params[len(args):])
        g = grid + (1, 1)
        compiled.run(g[0], g[1], g[2], _current_stream(key[0]), compiled.function, compiled.packed_metadata,
                     None, None, None, *full)

    def _remember(self, key, result) -> None:
        if hasattr(result, "result"):  # an asynchronous compile's future
            result = result.result()
        if all(hasattr(result, name) for name in ("run", "function", "packed_metadata")):
            self.compiled[key] = result
        else:  # the interpreter, or a Triton without this launch interface: its own path from now on
            self.fast = False


_launches: Dict[int, TritonLaunch] = {}  # id(kernel) -> its launcher (kernels are module-level objects)


def launch(kernel, grid, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` through the kernel's :class:`TritonLaunch`."""
    launcher = _launches.get(id(kernel))
    if launcher is None:
        launcher = _launches[id(kernel)] = TritonLaunch(kernel)
    launcher(grid, *args, **meta)
