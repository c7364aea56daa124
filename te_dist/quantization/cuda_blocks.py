"""The 1x128 block cast of activations and gradients writing both copies from one read (``cast_blocks.cu``):
Float8BlockScaling's rowwise 1x128 and columnwise 128x1 blocks, rows optionally gathered through an index.

Why CUDA here: one read of x (or of its gathered rows, never written in bf16) writes both copies and their
scales; the Triton tile cast does the same in more passes. Behind ``te_dist.settings.cuda_block_cast`` (on by
default) and ``cuda_block_cast_launch`` (docs/settings.md). Built on first use like ``cuda_rowcol``; a failed
build warns once and the callers keep the Triton tile cast. Nothing here runs at import.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from .. import settings
from .plain_cuda import DTYPES, FORMATS, PlainLibrary, launch_on, open_c_functions

__all__ = ["SOURCE", "BLOCK", "BLOCK_LAUNCHES", "blocks_fit", "blocks_enabled_for", "cast_blocks"]

SOURCE = Path(__file__).resolve().parent / "cast_blocks.cu"
BLOCK = 128  # the block length and square tile: the rows cast and C must be multiples
# the kernel's launches (te_dist.settings.cuda_block_cast_launch), by id: how it takes amaxes and converts to FP8
BLOCK_LAUNCHES = ("one value per conversion", "two values per conversion",
                  "two values per conversion, amaxes from 16-bit magnitude bits two at a time")
_BLOCK_DTYPES = (torch.bfloat16, torch.float16)  # the kernel's 16-bit tiles


class _Library:
    def __init__(self, path: Path):
        c = ctypes
        self._lib = open_c_functions(path, "te_cb", {
            "te_cb_blocks": [c.c_void_p] * 6 + [c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_float] + [c.c_int] * 3
            + [c.c_void_p],
            "te_cb_blocks_on_host": [c.c_void_p] * 6 + [c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_float]
            + [c.c_int] * 3,
        })

    def blocks_on_host(self, x: torch.Tensor, fp8_dtype: torch.dtype, fmt_max: float, power_2: bool, *,
                       rowwise: bool = True, col_scales_t: bool = False, gather: Optional[torch.Tensor] = None,
                       launch: int = 0):
        """The block kernel's four phases on the host over a CPU bf16 or fp16 x [R, C] (the CPU tests' check of
        its tiling, scales, layouts and each launch's amaxes and conversions): :func:`cast_blocks`'s outputs."""
        if x.device.type != "cpu" or x.dtype not in _BLOCK_DTYPES or x.dim() != 2:
            raise ValueError(f"blocks_on_host takes a CPU x [R, C] of {_BLOCK_DTYPES}, received {tuple(x.shape)} "
                             f"{x.dtype} on {x.device}")
        x = x.contiguous()
        idx = None if gather is None else gather.to(torch.int64).contiguous()
        outs = _block_outputs(x, idx, fp8_dtype, rowwise, col_scales_t)
        rows, cols = outs[2].shape[1], outs[2].shape[0]
        rc = self._lib.te_cb_blocks_on_host(x.data_ptr(), None if idx is None else idx.data_ptr(),
                                            *(None if t is None else t.data_ptr() for t in outs), rows, cols,
                                            DTYPES[x.dtype], FORMATS[fp8_dtype], fmt_max, int(power_2),
                                            int(col_scales_t), launch)
        if rc != 0:
            raise ValueError(f"te_cb_blocks_on_host refused x {tuple(x.shape)} -> {fp8_dtype}")
        return outs


_LIBRARY = PlainLibrary(SOURCE, _Library, "the CUDA 1x128 block cast", "the Triton tile cast runs instead")


def _block_outputs(x, idx, fp8_dtype, rowwise: bool, col_scales_t: bool):
    """(row data, row scales, col data, col scales) for :func:`cast_blocks` (None for a copy not asked for)."""
    rows, cols = (x.shape[0] if idx is None else idx.shape[0]), x.shape[1]
    row = col = None, None
    if rowwise:
        row = (torch.empty((rows, cols), dtype=fp8_dtype, device=x.device),
               torch.empty((rows, cols // BLOCK), dtype=torch.float32, device=x.device))
    col_scale_shape = (rows // BLOCK + 1, cols) if col_scales_t else (cols, rows // BLOCK)
    col = (torch.empty((cols, rows), dtype=fp8_dtype, device=x.device),
           torch.empty(col_scale_shape, dtype=torch.float32, device=x.device))
    return (*row, *col)


def blocks_fit(x: torch.Tensor, fp8_dtype: torch.dtype, gather: Optional[torch.Tensor] = None) -> bool:
    """Whether the block kernel takes x [R, C] (or its rows ``gather``, a 1-D int64 index on x's device): a 2-D
    CUDA bf16 or fp16 tensor, the rows cast and C multiples of ``BLOCK`` (no build, no device query)."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype in _BLOCK_DTYPES and fp8_dtype in FORMATS and x.numel() > 0):
        return False
    if gather is not None and (gather.dtype != torch.int64 or gather.dim() != 1 or gather.device != x.device):
        return False
    rows = x.shape[0] if gather is None else gather.shape[0]
    return rows > 0 and rows % BLOCK == 0 and x.shape[1] % BLOCK == 0


def blocks_enabled_for(x: torch.Tensor, fp8_dtype: torch.dtype, gather: Optional[torch.Tensor] = None) -> bool:
    """The switch is on, x fits and the library is available (built on the first call that asks)."""
    return settings.current().cuda_block_cast and blocks_fit(x, fp8_dtype, gather) and _LIBRARY.get() is not None


def cast_blocks(x: torch.Tensor, fp8_dtype: torch.dtype, fmt_max: float, power_2: bool, *, rowwise: bool = True,
                col_scales_t: bool = False, gather: Optional[torch.Tensor] = None, launch: Optional[int] = None):
    """The 1x128 block cast of x [R, C] (or of its rows ``gather``, int64, negative: a zero row) writing the
    columnwise copy and, with ``rowwise``, the rowwise one: (row data [R, C] or None, row scale_inv [R, C/128]
    or None, col data [C, R], col scale_inv [C, R/128], or M-major [R/128 + 1, C] with a zero last row with
    ``col_scales_t``), the values of triton_casts.cast_fp8_blocks. ``launch``: an index of :data:`BLOCK_LAUNCHES`
    (None: ``te_dist.settings.cuda_block_cast_launch``); every launch writes the same bytes. Call only where
    :func:`blocks_enabled_for`."""
    if launch is None:
        launch = settings.current().cuda_block_cast_launch
    if not isinstance(launch, int) or isinstance(launch, bool) or not 0 <= launch < len(BLOCK_LAUNCHES):
        raise ValueError(f"cast_blocks' launch is an index of BLOCK_LAUNCHES (0-{len(BLOCK_LAUNCHES) - 1}) or None, "
                         f"received {launch!r}")
    if not blocks_fit(x, fp8_dtype, gather):
        got = "none" if gather is None else f"{gather.dtype} {tuple(gather.shape)} on {gather.device}"
        raise ValueError(f"cast_blocks takes a CUDA x [R, C] of {_BLOCK_DTYPES} with the rows cast and C multiples "
                         f"of {BLOCK}, a 1-D int64 gather on its device and an FP8 dtype of {tuple(FORMATS)}, "
                         f"received {tuple(x.shape)} {x.dtype} on {x.device} -> {fp8_dtype}, gather {got}")
    lib = _LIBRARY.get()
    if lib is None:
        raise RuntimeError(f"the CUDA 1x128 block cast is unavailable: {_LIBRARY.error}")
    x = x.contiguous()
    idx = None if gather is None else gather.contiguous()
    outs = _block_outputs(x, idx, fp8_dtype, rowwise, col_scales_t)
    rows, cols = outs[2].shape[1], outs[2].shape[0]
    launch_on(lib._lib, "te_cb_blocks", x.device, x.data_ptr(), None if idx is None else idx.data_ptr(),
              *(None if t is None else t.data_ptr() for t in outs), rows, cols, DTYPES[x.dtype], FORMATS[fp8_dtype],
              float(fmt_max), int(power_2), int(col_scales_t), launch)
    return outs
