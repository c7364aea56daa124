"""Quantized operands in the layouts the FP8 grouped GEMMs read (pure torch; no CUDA needed).

Why one adapter: the quantizers produce per-tensor ``Float8Tensor``s (one scale) or ``Float8BlockTensor``s (1x128 /
128x128 block scales, rowwise and columnwise copies), while the block-scaled kernels
(cutlass_kernels/fp8_block_gemm.cu) read every operand K-major with float32 block scales in fixed layouts. Per-tensor
FP8 runs on the same kernel source built with tensor scales: each operand's one scale is passed as it is
(``tensor_scales``) and its transposed copies are the data transposed (written by the cast in the same pass when the
quantizer was asked for the columnwise usage). Only a call that mixes a per-tensor operand with a block-scaled one has
the per-tensor scale broadcast into blocks (``scale_tables=True``).

Layouts per GEMM (E experts, T rows, K in-features, N out-features, all /128 in blocks):

| GEMM  | A (data, scales)                          | B (data, scales)                                 |
|-------|-------------------------------------------|--------------------------------------------------|
| fwd   | x rowwise [T, K], [T, K/128]              | w rowwise [E, N, K], [E, K/128, N/128]            |
| dgrad | dy rowwise [T, N], [T, N/128]             | w columnwise [E, K, N], [E, N/128, K/128]         |
| wgrad | dy columnwise [N, T], [T/128 + 1, N]      | x columnwise [K, T], [T/128 + 1, K]               |

(wgrad's scale tables carry one spare block row so a group that starts inside a block - per-tensor
scales need only 16-row alignment - never reads past the end.)

Weights are converted once per weight version (:func:`prepare_weight`); activations per call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..quantization.tensors import Float8BlockTensor, Float8Tensor, QuantizedTensor

__all__ = ["BLOCK", "QuantizedWeight", "prepare_weight", "rowwise_operand", "columnwise_operand", "fp8_format",
           "copy_format", "dequantized", "tensor_scales", "one_scale"]

BLOCK = 128
_FORMATS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def fp8_format(data) -> str:
    """"e4m3" or "e5m2" for an FP8 data tensor or dtype (ValueError for anything else)."""
    dtype = data if isinstance(data, torch.dtype) else data.dtype
    fmt = _FORMATS.get(dtype)
    if fmt is None:
        raise ValueError(f"FP8 grouped GEMMs take float8_e4m3fn or float8_e5m2 data, received {dtype}")
    return fmt


class QuantizedWeight(NamedTuple):
    """A weight [E, N, K] quantized once per version, in the layouts its two GEMMs read."""

    fwd_data: torch.Tensor  # [E, N, K]
    fwd_scale: torch.Tensor  # [E, K/128, N/128]
    dgrad_data: torch.Tensor  # [E, K, N]
    dgrad_scale: torch.Tensor  # [E, N/128, K/128]
    source: QuantizedTensor  # the quantizer's tensor (the emulated path dequantizes it)

    @property
    def shape(self):
        return self.source.shape


def _check_block_copy(copy, what: str, block_rows: int) -> None:
    if copy is None:
        raise ValueError(f"{what} copy missing: quantize with that usage for the FP8 grouped GEMM")
    if block_rows and (copy.block_cols != BLOCK or copy.block_rows != block_rows):
        raise ValueError(f"{what} copy has {copy.block_rows}x{copy.block_cols} blocks; the FP8 grouped GEMM "
                         f"takes {block_rows}x{BLOCK}")


def prepare_weight(wq: QuantizedTensor) -> QuantizedWeight:
    """Both GEMM layouts of a quantized weight [E, N, K] (block: both copies, 128x128)."""
    if len(wq.shape) != 3:
        raise ValueError(f"a grouped weight is [E, N, K], received shape {tuple(wq.shape)}")
    E, N, K = wq.shape
    if (N % BLOCK or K % BLOCK) and (isinstance(wq, Float8BlockTensor) or N % 16 or K % 16):  # per-tensor: 16-byte rows
        raise ValueError(f"FP8 grouped GEMM weights need N and K multiples of {BLOCK} (per-tensor: 16), got {N=} {K=}")
    if isinstance(wq, Float8BlockTensor):
        _check_block_copy(wq.rowwise, "weight rowwise", BLOCK)
        _check_block_copy(wq.columnwise, "weight columnwise", BLOCK)
        return QuantizedWeight(wq.rowwise.data, wq.columnwise.scale_inv.contiguous(), wq.columnwise.data,
                               wq.rowwise.scale_inv.contiguous(), wq)
    if isinstance(wq, Float8Tensor):
        s = wq.scale_inv.reshape(1, 1, 1).float()
        kb, nb = -(-K // BLOCK), -(-N // BLOCK)  # block tables: the mixed-operand path's (dgrad: the cast's data_t)
        return QuantizedWeight(wq.data, s.expand(E, kb, nb).contiguous(), wq.transpose_data(),
                               s.expand(E, nb, kb).contiguous(), wq)
    raise TypeError(f"FP8 grouped GEMMs take Float8Tensor or Float8BlockTensor weights, received {type(wq).__name__}")


def tensor_scales(*operands) -> bool:
    """Every operand is per-tensor scaled (a Float8Tensor, or a QuantizedWeight made from one): the
    call runs the tensor-scaled kernels, which read each operand's one scale as it is."""
    return all(isinstance(q.source if isinstance(q, QuantizedWeight) else q, Float8Tensor) for q in operands)


def one_scale(q) -> torch.Tensor:
    """The float32 scale of a per-tensor operand (a Float8Tensor or a QuantizedWeight made from one)."""
    q = q.source if isinstance(q, QuantizedWeight) else q
    return q.scale_inv if q.scale_inv.dtype == torch.float32 else q.scale_inv.float()


def rowwise_operand(q: QuantizedTensor, scale_tables: bool = True):
    """(data [R, C], scales [R, C/128]) of a 2-D quantized activation, quantized along C; a
    per-tensor operand's scales are its one scale when ``scale_tables`` is False."""
    if isinstance(q, Float8BlockTensor):
        _check_block_copy(q.rowwise, "rowwise", 1)
        return q.rowwise.data, q.rowwise.scale_inv.contiguous()
    if isinstance(q, Float8Tensor):
        if q.data is None:
            raise ValueError("rowwise copy missing: this Float8Tensor holds only its transposed data (a wgrad copy)")
        if not scale_tables:
            return q.data, one_scale(q)
        R, C = q.data.shape
        return q.data, q.scale_inv.reshape(1, 1).float().expand(R, C // BLOCK).contiguous()
    raise TypeError(f"FP8 grouped GEMMs take Float8Tensor or Float8BlockTensor operands, received {type(q).__name__}")


def columnwise_operand(q: QuantizedTensor, scale_tables: bool = True):
    """(data [C, R] = the operand transposed, scales [R/128 + 1, C]) of a 2-D activation [R, C], quantized along R:
    the wgrad operand, which contracts over rows (per-tensor: its one scale when ``scale_tables`` is False)."""
    R, C = q.shape
    blocks = R // BLOCK + 1
    if isinstance(q, Float8BlockTensor):
        _check_block_copy(q.columnwise, "columnwise", 1)
        if q.columnwise.scale_inv_t is not None:  # the cast wrote this layout too
            return q.columnwise.data, q.columnwise.scale_inv_t
        scale = q.columnwise.scale_inv  # [C, R/128]
        out = scale.new_zeros(blocks, C)
        out[: scale.shape[1]] = scale.t()
        return q.columnwise.data, out
    if isinstance(q, Float8Tensor):
        # the transposed data the cast wrote in the same pass, else a transpose here
        if not scale_tables:
            return q.transpose_data(), one_scale(q)
        return q.transpose_data(), q.scale_inv.reshape(1, 1).float().expand(blocks, C).contiguous()
    raise TypeError(f"FP8 grouped GEMMs take Float8Tensor or Float8BlockTensor operands, received {type(q).__name__}")


def copy_format(q: QuantizedTensor, usage: str) -> str:
    """The element format of the copy a GEMM of ``usage`` reads (ValueError when it is missing)."""
    if isinstance(q, Float8BlockTensor):
        copy = getattr(q, usage)
        _check_block_copy(copy, usage, 0)
        return fp8_format(copy.data)
    if isinstance(q, Float8Tensor):
        return fp8_format(q.fp8_dtype)
    raise TypeError(f"FP8 grouped GEMMs take Float8Tensor or Float8BlockTensor operands, received {type(q).__name__}")


def dequantized(q, usage: str, dtype: torch.dtype) -> torch.Tensor:
    """The operand's values in ``dtype`` from the copy a GEMM of that ``usage`` reads (the
    emulated path: exactly what the native kernels multiply, in high precision)."""
    return (q.source if isinstance(q, QuantizedWeight) else q).dequantize(dtype, usage=usage)
