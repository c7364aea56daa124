"""The plain CUDA casts' libraries (``cast_rowcol.cu``, ``cast_blocks.cu``: no CUTLASS): each built into the kernel
cache and opened on its first use, never at import; where one cannot be (no nvcc, a failed build, a library that
does not open), a warning says so once and its callers keep their Triton path. Also the dtype and FP8 format ids
their C ABIs share."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

__all__ = ["DTYPES", "FORMATS", "PlainLibrary", "open_c_functions", "launch_on"]

DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # x's dtype id in the kernels' C ABI
FORMATS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}  # the FP8 format id in the kernels' C ABI


def open_c_functions(path: Path, prefix: str, argtypes: dict) -> ctypes.CDLL:
    """The library at ``path`` with its C ABI declared: each function ``name: [argument types]`` returning an int
    (0 or an error code), and ``<prefix>_last_error`` returning the text of the last error."""
    lib = ctypes.CDLL(str(path))
    getattr(lib, f"{prefix}_last_error").restype = ctypes.c_char_p
    for name, types in argtypes.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = ctypes.c_int, types
    return lib


def launch_on(lib: ctypes.CDLL, name: str, device: torch.device, *args) -> None:
    """``lib.<name>(*args, stream)`` on ``device``'s current stream: the launch goes to the current device, so it
    switches only where ``device`` is another (the callers already run there); a non-zero return raises with the
    library's ``<prefix>_last_error`` (the prefix: ``name`` up to its second underscore)."""
    with contextlib.nullcontext() if device.index == torch.cuda.current_device() else torch.cuda.device(device):
        rc = getattr(lib, name)(*args, torch.cuda.current_stream(device).cuda_stream)
    if rc != 0:
        error = getattr(lib, "_".join(name.split("_")[:2]) + "_last_error")().decode(errors="replace")
        raise RuntimeError(f"{name} launch failed: {error}")


class PlainLibrary:
    """``open_fn(path)`` of ``source``'s library, opened (built first if needed) on the first :meth:`get` and kept.
    Where it cannot be, ``get`` is None from then on, ``error`` says why, and the first ``get`` warned that
    ``what`` is unavailable and ``fallback`` runs instead (no rebuild on every call)."""

    def __init__(self, source: Path, open_fn, what: str, fallback: str):
        self.source, self._open_fn, self.what, self.fallback = source, open_fn, what, fallback
        self._lock = threading.Lock()
        self._lib = None
        self.error: Optional[str] = None

    @property
    def tried(self) -> bool:
        """Whether a ``get`` has opened the library or failed to."""
        return self._lib is not None or self.error is not None

    def get(self):
        """The opened library, or None where it cannot be built or opened here (asked on every cast: one check)."""
        if self._lib is None and self.error is None:
            with self._lock:
                if not self.tried:
                    try:
                        from cutlass_kernels.build import open_plain_source  # nvcc and the kernel cache

                        self._lib = open_plain_source(self.source, self._open_fn)
                    except Exception as exc:  # no nvcc, a failed build, a library that does not open
                        self.error = repr(exc)
                        warnings.warn(f"te_dist: {self.what} ({self.source.name}) is unavailable ({exc!r:.300}); "
                                      f"{self.fallback}")
        return self._lib
