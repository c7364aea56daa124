"""The FP8 casts writing both GEMM layouts from one read (``cast_rowcol.cu``): the per-tensor cast of
stacks of matrices (a grouped weight's fprop and dgrad copies), and the 1x128 block cast of activations and
gradients (rows, optionally gathered through an index).

Why CUDA here: the cast-then-transpose path reads the FP8 bytes back (5 bytes moved per element
instead of 4), and the Triton kernel that wrote both copies in one pass placed bytes wrongly on
Hopper GPUs; this kernel moves the transposed tile through shared memory as whole words.

Behind ``te_dist.settings.cuda_rowcol_cast`` and ``cuda_block_cast`` (both on by default: docs/settings.md).
The library is compiled into the kernel cache on first use, like the grouped GEMMs; a failed build warns
once and the callers keep the Triton paths. Nothing here runs at import.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import warnings
from pathlib import Path
from typing import Optional, Tuple

import torch

from .. import settings

__all__ = ["SOURCE", "TILE_ROWS", "TILE_COLS", "BLOCK", "BLOCK_LAUNCHES", "fits", "enabled_for", "cast_rowcol",
           "blocks_fit", "blocks_enabled_for", "cast_blocks"]

SOURCE = Path(__file__).resolve().parent / "cast_rowcol.cu"
TILE_ROWS, TILE_COLS = 64, 128  # one block's tile (cast_rowcol.cu): R and C must be multiples
BLOCK = 128  # the 1x128 block cast's block length and square tile: its R and C must be multiples
# the block kernel's launches (te_dist.settings.cuda_block_cast_launch), by id: how phase 3 converts to FP8
BLOCK_LAUNCHES = ("one value per conversion", "two values per conversion",
                  "two values per conversion, amaxes from 16-bit magnitude bits two at a time")
_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_BLOCK_DTYPES = (torch.bfloat16, torch.float16)  # the block kernel's 16-bit tiles
_FORMATS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}

_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library, or "error": why it is unavailable


class _Library:
    def __init__(self, path: Path):
        c = ctypes
        lib = ctypes.CDLL(str(path))
        lib.te_cr_last_error.restype = c.c_char_p
        lib.te_cr_cast.restype = c.c_int
        lib.te_cr_cast.argtypes = [c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int64, c.c_int64,
                                   c.c_int64, c.c_int, c.c_int, c.c_float, c.c_void_p]
        lib.te_cr_cast_on_host.restype = c.c_int
        lib.te_cr_cast_on_host.argtypes = [c.c_void_p, c.c_void_p, c.c_void_p, c.c_float, c.c_void_p, c.c_int64,
                                           c.c_int64, c.c_int64, c.c_int, c.c_float]
        lib.te_cr_blocks.restype = c.c_int
        lib.te_cr_blocks.argtypes = [c.c_void_p] * 6 + [c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_float, c.c_int,
                                                        c.c_int, c.c_int, c.c_void_p]
        lib.te_cr_blocks_on_host.restype = c.c_int
        lib.te_cr_blocks_on_host.argtypes = [c.c_void_p] * 6 + [c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_float,
                                                                c.c_int, c.c_int, c.c_int]
        self._lib = lib

    def cast(self, *args) -> None:
        if self._lib.te_cr_cast(*args) != 0:
            raise RuntimeError(f"cast_rowcol launch failed: {self._lib.te_cr_last_error().decode(errors='replace')}")

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
                                          x.numel() // (rows * cols), rows, cols, _FORMATS[fp8_dtype], fmt_max)
        if rc != 0:
            raise ValueError(f"te_cr_cast_on_host refused x {tuple(x.shape)} -> {fp8_dtype}")
        return data, data_t

    def blocks(self, *args) -> None:
        if self._lib.te_cr_blocks(*args) != 0:
            error = self._lib.te_cr_last_error().decode(errors="replace")
            raise RuntimeError(f"cast_rowcol block launch failed: {error}")

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
        rc = self._lib.te_cr_blocks_on_host(x.data_ptr(), None if idx is None else idx.data_ptr(),
                                            *(None if t is None else t.data_ptr() for t in outs), rows, cols,
                                            _DTYPES[x.dtype], _FORMATS[fp8_dtype], fmt_max, int(power_2),
                                            int(col_scales_t), launch)
        if rc != 0:
            raise ValueError(f"te_cr_blocks_on_host refused x {tuple(x.shape)} -> {fp8_dtype}")
        return outs


def _library() -> Optional[_Library]:
    """The compiled library, or None (warned once) when it cannot be built or opened here."""
    if "lib" not in _state and "error" not in _state:
        with _lock:
            if "lib" not in _state and "error" not in _state:
                try:
                    from cutlass_kernels.build import open_plain_source  # nvcc and the kernel cache

                    _state["lib"] = open_plain_source(SOURCE, _Library)
                except Exception as exc:  # no nvcc, a failed build, a library that does not open
                    _state["error"] = repr(exc)
                    warnings.warn(f"te_dist: the one-pass FP8 cast (cast_rowcol.cu) is unavailable ({exc!r:.300}); "
                                  "the cast then the byte transpose run instead")
    return _state.get("lib")


def fits(x: torch.Tensor, fp8_dtype: torch.dtype) -> bool:
    """Whether the kernel takes x [..., R, C]: a CUDA tensor of a supported dtype, R a multiple of
    ``TILE_ROWS``, C of ``TILE_COLS`` (a pure shape check: no build, no device query)."""
    return (x.is_cuda and x.dim() >= 2 and x.dtype in _DTYPES and fp8_dtype in _FORMATS and x.numel() > 0
            and x.shape[-2] % TILE_ROWS == 0 and x.shape[-1] % TILE_COLS == 0)


def enabled_for(x: torch.Tensor, fp8_dtype: torch.dtype) -> bool:
    """The switch is on, x fits and the library is available (built on the first call that asks)."""
    return settings.current().cuda_rowcol_cast and fits(x, fp8_dtype) and _library() is not None


def cast_rowcol(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, fmt_max: float,
                amax_bits: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(data [..., R, C], data_t [..., C, R]) = fp8(clamp(x * scale)) in both layouts; ``scale``: a
    float32 one-element tensor on x's device; ``amax_bits``: an int32 tensor whose first element takes
    max(its value, the bits of max|x|). Call only where :func:`enabled_for` is True."""
    if not fits(x, fp8_dtype):
        raise ValueError(f"cast_rowcol takes a CUDA x [..., R, C] of {tuple(_DTYPES)} with R % {TILE_ROWS} == 0 and "
                         f"C % {TILE_COLS} == 0 and an FP8 dtype of {tuple(_FORMATS)}, received {tuple(x.shape)} "
                         f"{x.dtype} on {x.device} -> {fp8_dtype}")
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != x.device:
        raise ValueError(f"scale must be one float32 value on {x.device}, received {scale.dtype} "
                         f"{tuple(scale.shape)} on {scale.device}")
    if amax_bits is not None and (amax_bits.dtype != torch.int32 or amax_bits.device != x.device):
        raise ValueError(f"amax_bits must be int32 on {x.device}, received {amax_bits.dtype} on {amax_bits.device}")
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the one-pass FP8 cast is unavailable: {_state.get('error')}")
    x = x.contiguous()
    rows, cols = x.shape[-2], x.shape[-1]
    matrices = x.numel() // (rows * cols)
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    data_t = torch.empty((*x.shape[:-2], cols, rows), dtype=fp8_dtype, device=x.device)
    # the launch goes to the current device: switch only where x lives elsewhere (the callers already run there)
    on_x = x.device.index == torch.cuda.current_device()
    with contextlib.nullcontext() if on_x else torch.cuda.device(x.device):
        lib.cast(x.data_ptr(), data.data_ptr(), data_t.data_ptr(), scale.data_ptr(),
                 None if amax_bits is None else amax_bits.data_ptr(), matrices, rows, cols, _DTYPES[x.dtype],
                 _FORMATS[fp8_dtype], float(fmt_max), torch.cuda.current_stream(x.device).cuda_stream)
    return data, data_t


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
    if not (x.is_cuda and x.dim() == 2 and x.dtype in _BLOCK_DTYPES and fp8_dtype in _FORMATS and x.numel() > 0):
        return False
    if gather is not None and (gather.dtype != torch.int64 or gather.dim() != 1 or gather.device != x.device):
        return False
    rows = x.shape[0] if gather is None else gather.shape[0]
    return rows > 0 and rows % BLOCK == 0 and x.shape[1] % BLOCK == 0


def blocks_enabled_for(x: torch.Tensor, fp8_dtype: torch.dtype, gather: Optional[torch.Tensor] = None) -> bool:
    """The switch is on, x fits and the library is available (built on the first call that asks)."""
    return settings.current().cuda_block_cast and blocks_fit(x, fp8_dtype, gather) and _library() is not None


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
                         f"of {BLOCK}, a 1-D int64 gather on its device and an FP8 dtype of {tuple(_FORMATS)}, "
                         f"received {tuple(x.shape)} {x.dtype} on {x.device} -> {fp8_dtype}, gather {got}")
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the one-pass FP8 cast is unavailable: {_state.get('error')}")
    x = x.contiguous()
    idx = None if gather is None else gather.contiguous()
    outs = _block_outputs(x, idx, fp8_dtype, rowwise, col_scales_t)
    rows, cols = outs[2].shape[1], outs[2].shape[0]
    on_x = x.device.index == torch.cuda.current_device()
    with contextlib.nullcontext() if on_x else torch.cuda.device(x.device):
        lib.blocks(x.data_ptr(), None if idx is None else idx.data_ptr(),
                   *(None if t is None else t.data_ptr() for t in outs), rows, cols, _DTYPES[x.dtype],
                   _FORMATS[fp8_dtype], float(fmt_max), int(power_2), int(col_scales_t), launch,
                   torch.cuda.current_stream(x.device).cuda_stream)
    return outs
