"""Quantized tensor containers: what a quantizer returns and a (block-)scaled GEMM consumes.

Layouts (the contract for GEMM kernels):

``Float8Tensor`` (DelayedScaling, Float8CurrentScaling)
    ``data``: FP8, x's shape, row-major. ``scale_inv``: float32 0-dim, ``x ~= data * scale_inv``.
    A GEMM that needs the other operand orientation uses ``transpose_data()`` (same scale): the
    ``data_t`` the cast wrote in the same pass when asked for the columnwise usage, else a transpose.

``BlockScaledTensor`` (Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling) holds up to two
copies, ``rowwise`` and ``columnwise`` (:class:`BlockScaledData`). Each copy is quantized along
*its own last dimension* (the GEMM reduction dimension, K):
    ``rowwise``: ``data[..., M, K]`` = x itself, blocks run along x's last dim;
    ``columnwise``: ``data[..., K, M]`` = x transposed (last two dims), blocks run along x's
    second-to-last dim. This is the operand a GEMM reducing over x's rows (wgrad) consumes.
    ``scale_inv[..., R/br, C/bc]`` for data ``[..., R, C]`` and block ``br x bc``:
      Float8BlockScaling: float32, 1x128 (``*_block_scaling_dim=1``) or 128x128 (``=2``) blocks;
        a DeepGEMM-style kernel reads the 1x128 scales M-major: ``scale_inv.transpose(-1, -2).contiguous()``.
      MXFP8: ``torch.float8_e8m0fnu`` (value ``2**(code-127)``), 1x32 blocks.
      NVFP4: ``torch.float8_e4m3fn`` decode scales, 1x16 blocks, or 16x16 for 2D weights (one scale
        per 16x16 tile; a 1x16 kernel repeats each row of scales 16 times); ``data`` is uint8 with two
        E2M1 nibbles per byte (element 2i low nibble, 2i+1 high nibble: see :mod:`.e2m1`), so
        ``data.shape[-1] == C // 2``; and a tensor-level ``global_scale_inv`` (float32 0-dim, per copy
        because a Hadamard-transformed copy has its own amax): ``x ~= e2m1(data) * scale_inv * global_scale_inv``.
    ``hadamard=True`` means the copy holds ``apply_rht(x_copy)`` (NVFP4 wgrad operands);
    :meth:`dequantize` undoes it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..recipe import Format
from .cast import dequantize_blocks
from .e2m1 import e2m1_codes_to_float, unpack_e2m1
from .hadamard import invert_rht

__all__ = [
    "QuantizedTensor",
    "Float8Tensor",
    "BlockScaledData",
    "BlockScaledTensor",
    "Float8BlockTensor",
    "MXFP8Tensor",
    "NVFP4Tensor",
]


class QuantizedTensor:
    """Base class: quantized storage of one high-precision tensor of ``shape`` and ``dtype``."""

    def __init__(self, shape, dtype: torch.dtype, device: torch.device):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device(device)

    def dequantize(self, dtype: Optional[torch.dtype] = None, usage: Optional[str] = None) -> torch.Tensor:
        """x's values from the copy a GEMM of ``usage`` ("rowwise" / "columnwise"; None: either) reads."""
        raise NotImplementedError

    def size(self, dim: Optional[int] = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


class Float8Tensor(QuantizedTensor):
    """Per-tensor scaled FP8. ``data_t``: the same bytes transposed (last two dims), when the cast
    wrote it in the same pass (the wgrad operand); ``data`` may then be None (a copy kept for
    wgrad alone), and the shape is still x's."""

    def __init__(self, data: Optional[torch.Tensor], scale_inv: torch.Tensor, fmt: Format, dtype: torch.dtype,
                 data_t: Optional[torch.Tensor] = None):
        if data is None and data_t is None:
            raise ValueError("Float8Tensor needs its data, its transposed data, or both")
        some = data if data is not None else data_t
        shape = data.shape if data is not None else (*data_t.shape[:-2], data_t.shape[-1], data_t.shape[-2])
        super().__init__(shape, dtype, some.device)
        self.data = data
        self.data_t = data_t
        self.scale_inv = scale_inv
        self.fmt = fmt

    @property
    def fp8_dtype(self) -> torch.dtype:
        return (self.data if self.data is not None else self.data_t).dtype

    def transpose_data(self) -> torch.Tensor:
        """Columnwise copy: the FP8 data with its last two dims swapped, contiguous."""
        if len(self.shape) < 2:
            raise ValueError(f"transpose_data needs at least 2 dims, got shape {tuple(self.shape)}")
        if self.data_t is not None:
            return self.data_t
        from .fused import transpose_fp8  # the Triton byte transpose where the fused casts run

        return transpose_fp8(self.data)

    def wgrad_copy(self) -> "Float8Tensor":
        """What a wgrad reads: the transposed copy alone when there is one (the data served fprop)."""
        if self.data_t is None or self.data is None:
            return self
        return Float8Tensor(None, self.scale_inv, self.fmt, self.dtype, data_t=self.data_t)

    def dequantize(self, dtype: Optional[torch.dtype] = None, usage: Optional[str] = None) -> torch.Tensor:
        """``usage="columnwise"``: from the transposed copy where there is one, the bytes a wgrad kernel reads."""
        from_t = self.data_t is not None and (usage == "columnwise" or self.data is None)
        data = self.data_t.transpose(-1, -2) if from_t else self.data
        return (data.to(torch.float32) * self.scale_inv).to(dtype or self.dtype)

    def take_rows(self, index: torch.Tensor, zero_rows: Optional[torch.Tensor] = None, *,
                  transposed: bool = False) -> "Float8Tensor":
        """Rows ``index`` of a 2-D tensor's data, the rows ``zero_rows`` of the result zero, same scale;
        ``transposed`` adds the result's transposed data (the wgrad operand).

        Why: with one scale per tensor, this is the quantization of the gathered rows whenever the
        gather keeps every row (same amax; FP8 zero is the zero byte), and it moves one byte per
        element instead of the two of a bf16 gather plus the cast (the MoE expert rows at EP size 1:
        te_dist.ops.basic.row_gather)."""
        if self.data is None or self.data.dim() != 2:
            raise ValueError(f"take_rows needs the rowwise data of a 2-D tensor, got shape {tuple(self.shape)} "
                             f"with{'out' if self.data is None else ''} rowwise data")
        if transposed:  # both layouts in one pass where the fused kernels run (fused.gather_rows_fp8)
            from .fused import gather_rows_fp8

            pair = gather_rows_fp8(self.data.view(torch.uint8), index, zero_rows)
            if pair is not None:
                rows, rows_t = (t.view(self.data.dtype) for t in pair)
                return Float8Tensor(rows, self.scale_inv, self.fmt, self.dtype, data_t=rows_t)
        rows = self.data.view(torch.uint8).index_select(0, index)
        if zero_rows is not None:
            rows.index_fill_(0, zero_rows, 0)
        out = Float8Tensor(rows.view(self.data.dtype), self.scale_inv, self.fmt, self.dtype)
        if transposed:
            out.data_t = out.transpose_data()
        return out


@dataclasses.dataclass(frozen=True)
class BlockScaledData:
    """One usage copy of a block-scaled tensor, quantized along its last dim (see module docstring)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block_rows: int
    block_cols: int
    transposed: bool = False
    hadamard: bool = False
    global_scale_inv: Optional[torch.Tensor] = None
    # 1x128 columnwise copies from the fused cast: the same scales M-major, [R/128 + 1, C] with a zero
    # last row (the FP8 wgrad kernel's layout; ``scale_inv`` is a view of it), else None
    scale_inv_t: Optional[torch.Tensor] = None

    def values(self, fmt: Format) -> torch.Tensor:
        """Element values before scaling, float32, in the copy's own layout."""
        if fmt is Format.E2M1:
            return e2m1_codes_to_float(unpack_e2m1(self.data))
        return self.data.to(torch.float32)


class BlockScaledTensor(QuantizedTensor):
    """Block-scaled storage with optional rowwise / columnwise copies (see module docstring)."""

    def __init__(
        self,
        shape,
        dtype: torch.dtype,
        fmt: Format,
        rowwise: Optional[BlockScaledData] = None,
        columnwise: Optional[BlockScaledData] = None,
    ):
        assert rowwise is not None or columnwise is not None, "a quantized tensor needs at least one copy"
        device = (rowwise or columnwise).data.device
        super().__init__(shape, dtype, device)
        self.fmt = fmt
        self.rowwise = rowwise
        self.columnwise = columnwise

    def dequantize(self, dtype: Optional[torch.dtype] = None, usage: Optional[str] = None) -> torch.Tensor:
        """Back to x's shape; ``usage`` "rowwise"/"columnwise" picks a copy (default: rowwise if present)."""
        if usage not in (None, "rowwise", "columnwise"):
            raise ValueError(f"usage must be None, 'rowwise' or 'columnwise', got {usage!r}")
        if usage is None:
            copy = self.rowwise if self.rowwise is not None else self.columnwise
        else:
            copy = getattr(self, usage)
            if copy is None:
                raise ValueError(f"this {type(self).__name__} holds no {usage} copy")
        out = dequantize_blocks(copy.values(self.fmt), copy.scale_inv, copy.block_rows, copy.block_cols)
        if copy.global_scale_inv is not None:
            out = out * copy.global_scale_inv
        if copy.hadamard:
            out = invert_rht(out)
        if copy.transposed:
            out = out.transpose(-1, -2)
        return out.to(dtype or self.dtype).reshape(self.shape)


class Float8BlockTensor(BlockScaledTensor):
    """Float8BlockScaling storage: FP8 elements, float32 scales per 1x128 or 128x128 block."""


class MXFP8Tensor(BlockScaledTensor):
    """MXFP8 storage: FP8 elements, E8M0 scales per 1x32 block."""


class NVFP4Tensor(BlockScaledTensor):
    """NVFP4 storage: packed E2M1 elements, E4M3 scales per 1x16 / 16x16 block, fp32 tensor scale."""
