"""The per-tensor FP8 cast of stacks of matrices writing both GEMM layouts from one read (``cast_rowcol.cu``): a
grouped weight's fprop and dgrad copies. The 1x128 block cast is ``cuda_blocks``.

Why CUDA here: the cast-then-transpose path reads the FP8 bytes back (5 bytes moved per element
instead of 4), and the Triton kernel that wrote both copies in one pass placed bytes wrongly on
Hopper GPUs; this kernel moves the transposed tile through shared memory as whole words.

Behind ``te_dist.settings.cuda_rowcol_cast`` (on by default: docs/settings.md). The library is compiled into the
kernel cache on first use, like the grouped GEMMs; a failed build warns once and the callers keep the Triton
path. Nothing here runs at import.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional, Tuple

import torch

from .. import settings
from .plain_cuda import DTYPES, FORMATS, PlainLibrary, launch_on, open_c_functions

__all__ = ["SOURCE", "TILE_ROWS", "TILE_COLS", "fits", "enabled_for", "cast_rowcol"]

SOURCE = Path(__file__).resolve().parent / "cast_rowcol.cu"
TILE_ROWS, TILE_COLS = 64, 128  # one block's tile (cast_rowcol.cu): R and C must be multiples


class _Library:
    def __init__(self, path: Path):
        c = ctypes
        self._lib = open_c_functions(path, "te_cr", {
            "te_cr_cast": [c.c_void_p] * 5 + [c.c_int64] * 3 + [c.c_int, c.c_int, c.c_float, c.c_void_p],
            "te_cr_cast_on_host": [c.c_void_p] * 3 + [c.c_float, c.c_void_p] + [c.c_int64] * 3 + [c.c_int, c.c_float],
        })

    def cast_on_host(self, x: torch.Tensor, scale: float, fp8_dtype: torch.dtype, fmt_max: float,
                     amax_bits: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The kernel's two phases run on the host over a CPU bf16 x (the CPU tests' check of its tiling,
        packing and layouts; no GPU needed)."""
        if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.shape[-2] % TILE_ROWS or x.shape[-1] % TILE_COLS:
            raise ValueError(f"cast_on_host takes a CPU bf16 x [..., R, C] on the tile, received {tuple(x.shape)} "
                             f"{x.dtype} on {x.device}")
        x = x.contiguous()
        rows, cols = x.shape[-2], x.shape[-1]
        data = torch.empty(x.shape, dtype=fp8_dtype)
        data_t = torch.empty((*x.shape[:-2], cols, rows), dtype=fp8_dtype)
        rc = self._lib.te_cr_cast_on_host(x.data_ptr(), data.data_ptr(), data_t.data_ptr(), scale,
                                          None if amax_bits is None else amax_bits.data_ptr(),
                                          x.numel() // (rows * cols), rows, cols, FORMATS[fp8_dtype], fmt_max)
        if rc != 0:
            raise ValueError(f"te_cr_cast_on_host refused x {tuple(x.shape)} -> {fp8_dtype}")
        return data, data_t


_LIBRARY = PlainLibrary(SOURCE, _Library, "the one-pass FP8 cast", "the cast then the byte transpose run instead")


def fits(x: torch.Tensor, fp8_dtype: torch.dtype) -> bool:
    """Whether the kernel takes x [..., R, C]: a CUDA tensor of a supported dtype, R a multiple of
    ``TILE_ROWS``, C of ``TILE_COLS`` (a pure shape check: no build, no device query)."""
    return (x.is_cuda and x.dim() >= 2 and x.dtype in DTYPES and fp8_dtype in FORMATS and x.numel() > 0
            and x.shape[-2] % TILE_ROWS == 0 and x.shape[-1] % TILE_COLS == 0)


def enabled_for(x: torch.Tensor, fp8_dtype: torch.dtype) -> bool:
    """The switch is on, x fits and the library is available (built on the first call that asks)."""
    return settings.current().cuda_rowcol_cast and fits(x, fp8_dtype) and _LIBRARY.get() is not None


def cast_rowcol(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, fmt_max: float,
                amax_bits: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(data [..., R, C], data_t [..., C, R]) = fp8(clamp(x * scale)) in both layouts; ``scale``: a
    float32 one-element tensor on x's device; ``amax_bits``: an int32 tensor whose first element takes
    max(its value, the bits of max|x|). Call only where :func:`enabled_for` is True."""
    if not fits(x, fp8_dtype):
        raise ValueError(f"cast_rowcol takes a CUDA x [..., R, C] of {tuple(DTYPES)} with R % {TILE_ROWS} == 0 and "
                         f"C % {TILE_COLS} == 0 and an FP8 dtype of {tuple(FORMATS)}, received {tuple(x.shape)} "
                         f"{x.dtype} on {x.device} -> {fp8_dtype}")
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != x.device:
        raise ValueError(f"scale must be one float32 value on {x.device}, received {scale.dtype} "
                         f"{tuple(scale.shape)} on {scale.device}")
    if amax_bits is not None and (amax_bits.dtype != torch.int32 or amax_bits.device != x.device):
        raise ValueError(f"amax_bits must be int32 on {x.device}, received {amax_bits.dtype} on {amax_bits.device}")
    lib = _LIBRARY.get()
    if lib is None:
        raise RuntimeError(f"the one-pass FP8 cast is unavailable: {_LIBRARY.error}")
    x = x.contiguous()
    rows, cols = x.shape[-2], x.shape[-1]
    matrices = x.numel() // (rows * cols)
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    data_t = torch.empty((*x.shape[:-2], cols, rows), dtype=fp8_dtype, device=x.device)
    launch_on(lib._lib, "te_cr_cast", x.device, x.data_ptr(), data.data_ptr(), data_t.data_ptr(), scale.data_ptr(),
              None if amax_bits is None else amax_bits.data_ptr(), matrices, rows, cols, DTYPES[x.dtype],
              FORMATS[fp8_dtype], float(fmt_max))
    return data, data_t
